"""A peer trainer side by side: vllm-project's `speculators` trained on the same stores.

venv.py builds its own environment, writer.py converts one of our stores into its training
files, launch.py runs its trainer (inside that environment, patched for a CPU), runner.py
drives a run from ours and measures it, convert.py turns its checkpoint into a drafter
directory `dflash eval` loads, compare.py does all of it for ours and theirs side by side.
Nothing here imports speculators into our environment, nor our package into its.
"""
