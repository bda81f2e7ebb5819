"""Entry point: python -m flexgen_h2o.eval (see cli.py)."""
import sys

from flexgen_h2o.eval.cli import main

sys.exit(main())
