"""A local `evaluate` metric (no hub at run time): ``evaluate.load(MODULE_DIR)``; see token_perplexity.py."""

import os

MODULE_DIR = os.path.dirname(os.path.abspath(__file__))
