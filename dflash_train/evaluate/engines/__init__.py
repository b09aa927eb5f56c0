"""The serving engines of `eval --served`, by --engine name.

shared.py holds what every engine shares (the prompts and stop rule it is given, its counts
read as rounds, the results and the served check); each engine is one module holding its
mode (a shared.ServedMode subclass), its plan (what it checks and finds before the first
forward) and how it runs the engine: vllm.py (with vllm_driver.py, the script vLLM's own
Python runs) and llama_cpp.py (with llama_server.py, the llama-server process). A new engine
is one such module and one entry here.
"""

from dflash_train.evaluate.engines.llama_cpp import LlamaCppMode
from dflash_train.evaluate.engines.shared import ServedMode
from dflash_train.evaluate.engines.vllm import VllmMode

SERVING_ENGINES: dict[str, type[ServedMode]] = {m.engine: m for m in (VllmMode, LlamaCppMode)}
"""Each engine's mode by its --engine name."""
