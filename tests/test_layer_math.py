"""The compiled layer math (csrc/layer_math.cpp: RMSNorm, SwiGLU's gate, RoPE) against the torch ops it replaces,
for a decode step's rows and a prompt's, and kernels.Kernels' dispatch to it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexgen_h2o.kernels import Kernels, dispatch, resolve
from flexgen_h2o.models import ops
from tests.kernel_inputs import rms_norm_bound, silu_mul_bound, torch_rms_norm, torch_rope
from tests.tolerances import assert_within


@pytest.mark.parametrize("rows, m", [(120, 576), (1, 64), (7, 13), (3, 1000)])
@pytest.mark.parametrize("wdtype", [torch.float16, torch.float32])
def test_rms_norm_matches_the_torch_ops(kernel, rows, m, wdtype):
    gen = torch.Generator().manual_seed(rows + m)
    x = torch.randn(rows, 1, m, generator=gen) * 3
    w = (torch.randn(m, generator=gen) * 0.5).to(wdtype)
    got = kernel.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.float32
    want = torch_rms_norm(x, w, 1e-5)
    assert_within(got, want, rms_norm_bound(want, m), "rms_norm")


def test_silu_mul_matches_the_torch_ops_over_the_whole_range(kernel):
    """Large negative and positive gates too (the sigmoid is taken from e^-|g|, so nothing overflows)."""
    gen = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.randn(120 * 1536 - 9, generator=gen) * 4,
                      torch.tensor([-100.0, -88.0, -30.0, -0.0, 0.0, 1e-30, 30.0, 88.0, 100.0])]).view(120, 1, 1536)
    up = torch.randn(120, 1, 1536, generator=gen)
    want = F.silu(gate) * up
    got = kernel.ext.silu_mul_(gate.clone(), up.contiguous())
    assert_within(got, want, silu_mul_bound(gate, up, want), "silu_mul")


@pytest.mark.parametrize("b, h, d", [(120, 9, 64), (2, 3, 8), (5, 1, 10)])
def test_rope_matches_the_torch_ops_on_a_head_view(kernel, b, h, d):
    """x as split_heads makes it for one token: a (b, h, 1, d) view of (b, 1, h * d) projections."""
    gen = torch.Generator().manual_seed(b)
    x = torch.randn(b, 1, h * d, generator=gen).view(b, 1, h, d).transpose(1, 2)
    angles = torch.rand(b, 1, 1, d, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    got = kernel.ext.rope_rows(x, cos, sin)
    assert got.shape == (b, h, 1, d) and got.is_contiguous()
    assert torch.equal(got, torch_rope(x, cos, sin))        # products rounded, then added: the same bits


@pytest.mark.parametrize("b, h, t, d", [(2, 9, 2048, 64), (3, 3, 5, 8), (1, 2, 7, 10), (2, 1, 3, 2)])
def test_rope_of_a_prompt_matches_the_torch_ops_bit_for_bit_on_any_thread_count(kernel, b, h, t, d):
    """A prompt's q or k as split_heads makes it, (b, h, t, d) over (b, t, h * d), each (sequence, token) with its
    own angles; SmolLM2's q of two 2,048-token prompts (2.4M floats) splits across threads. d = 10 and 2 leave a
    tail of each half to the scalar loop."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(b, t, h * d, generator=gen).view(b, t, h, d).transpose(1, 2)
    angles = torch.rand(b, 1, t, d, generator=gen) * 1000
    cos, sin = angles.cos(), angles.sin()
    want = torch_rope(x, cos, sin)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel.ext.rope_rows(x, cos, sin)
        torch.set_num_threads(1)
        one = kernel.ext.rope_rows(x, cos, sin)
    finally:
        torch.set_num_threads(before)
    assert two.shape == (b, h, t, d) and two.is_contiguous()
    assert torch.equal(two, want) and torch.equal(one, want)


def test_rope_sends_prompts_and_decode_tokens_to_any_build_without_asking_it(kernel):
    """The library takes only its own build (older revisions' builds, whose rope_rows took one token, are no longer
    told apart): Kernels.apply_rope sends a prompt and a decode token alike to the extension's rope_rows, asking
    it nothing else, and the prompt's values are the torch ops' bit for bit."""
    from types import SimpleNamespace
    calls = []
    only_rope = SimpleNamespace(rope_rows=lambda x, c, s: calls.append(x.shape[2]) or kernel.ext.rope_rows(x, c, s))
    kernels = Kernels(only_rope)
    x, cos = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
    assert torch.equal(kernels.apply_rope(x, cos, cos), torch_rope(x, cos, cos)) and calls == [4]
    kernels.apply_rope(x[:, :, :1], cos[:, :, :1], cos[:, :, :1])
    assert calls == [4, 1]


def test_a_prompt_sized_tensor_split_across_threads_gives_the_same_values(kernel):
    """Above 1M floats the kernel splits rows (RMSNorm) or 8-float blocks (SwiGLU) across torch's threads: each
    output is computed alone, so the values are those of one thread, and of the torch ops to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, 1100, 576, generator=gen), torch.randn(576, generator=gen).half()      # 1.27M floats
    gate, up = torch.randn(2, 700, 1537, generator=gen) * 4, torch.randn(2, 700, 1537, generator=gen)  # odd tail
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel.rms_norm(x, w, 1e-5), kernel.ext.silu_mul_(gate.clone(), up)
        torch.set_num_threads(1)
        one = kernel.rms_norm(x, w, 1e-5), kernel.ext.silu_mul_(gate.clone(), up)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])
    want = torch_rms_norm(x, w, 1e-5), F.silu(gate) * up
    assert_within(two[0], want[0], rms_norm_bound(want[0], 576), "rms_norm")
    assert_within(two[1], want[1], silu_mul_bound(gate, up, want[1]), "silu_mul")


def test_kernels_send_fp32_cpu_math_to_the_kernel(kernel, monkeypatch):
    calls = []
    for name in ("rms_norm_rows", "silu_mul_", "rope_rows"):
        real = getattr(kernel.ext, name)
        monkeypatch.setattr(kernel.ext, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    w = torch.randn(64).half()
    kernel.rms_norm(torch.randn(8, 1, 64), w, 1e-5)                              # a decode step: kernel
    kernel.rms_norm(torch.randn(8, 1, 64).half(), w, 1e-5)                       # fp16 (a GPU's): torch ops
    kernel.swiglu_mlp(torch.randn(4, 1, 16), *(torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 32)))
    cos = torch.randn(120, 1, 1, 64)
    kernel.apply_rope(torch.randn(120, 9, 1, 64), cos, cos)         # one token, SmolLM2's q at batch 120: kernel
    kernel.apply_rope(torch.randn(4, 2, 5, 8), torch.randn(4, 1, 5, 8), torch.randn(4, 1, 5, 8))   # prompt: kernel
    kernel.apply_rope(torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8))   # per-head angles
    half_angles = torch.randn(4, 1, 5, 8).half()                                   # angles of another dtype
    kernel.apply_rope(torch.randn(4, 2, 5, 8), half_angles, half_angles)
    assert calls == ["rms_norm_rows", "silu_mul_", "rope_rows", "rope_rows"]
    monkeypatch.setenv(dispatch.LAYER_MATH_SWITCH, "0")                                # switched off on its own
    off = resolve()                                                  # the switch is read when the kernels resolve
    assert off.ext is kernel.ext and not off.layer_math
    off.rms_norm(torch.randn(8, 1, 64), w, 1e-5)
    off.apply_rope(torch.randn(4, 2, 5, 8), torch.randn(4, 1, 5, 8), torch.randn(4, 1, 5, 8))
    off.swiglu_mlp(torch.randn(4, 1, 16), *(torch.randn(32, 16), torch.randn(32, 16), torch.randn(16, 32)))
    assert calls == ["rms_norm_rows", "silu_mul_", "rope_rows", "rope_rows"]


def test_step_context_computes_rope_angles_once_per_positions():
    """Every attention layer of a step asks for the same angles: the layers share one frequency tensor, so one
    computation serves them all; never across other frequencies, positions (a prefill chunk's rows) or dtypes."""
    from flexgen_h2o.models import build_llama_layers, resolve_model
    from flexgen_h2o.models.layer import StepContext
    layers = [layer for layer in build_llama_layers(resolve_model("smollm2-135m")) if layer.kind == "attn"]
    assert len(layers) == 30 and all(layer.inv_freq is layers[0].inv_freq for layer in layers)
    pos = torch.tensor([[5], [900]])
    ctx = StepContext(pos, torch.ones(2, 1, dtype=torch.bool), torch.float32)
    freq_a = layers[0].inv_freq
    cos, sin = ctx.rope(freq_a, torch.float32)
    assert ctx.rope(layers[-1].inv_freq, torch.float32)[0] is cos         # another layer: the same tensors
    want = ops.rope_cos_sin(pos, freq_a, torch.float32)                 # (b, t, d); the heads' axis added
    assert cos.shape == (2, 1, 1, 64) and torch.equal(cos[:, 0], want[0]) and torch.equal(sin[:, 0], want[1])
    other = ctx.rope(ops.rope_inv_freq(64, 500.0), torch.float32)[0]
    assert not torch.equal(other, cos)
    assert ctx.rope(freq_a, torch.float16)[0].dtype == torch.float16
    chunk = ctx.rows(1, 2)                                                # another sequence's positions
    assert torch.equal(chunk.rope(freq_a, torch.float32)[0], cos[1:])
