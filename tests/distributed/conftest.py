import os
import sys

HERE = os.path.dirname(__file__)
# `tiny_models` and `harness` from the model tests; `tp_ranks` (the spawned ranks' entry points) from here.
sys.path.insert(0, os.path.join(HERE, "..", "model"))
sys.path.insert(0, HERE)
