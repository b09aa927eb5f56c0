"""The target model, as every stage that runs it sees it.

Owns: loading a target (a transformers directory, a hub id or a GGUF file) and its
provenance (TargetInfo with its config hash and weights fingerprint), the guard that keeps
CPU runs out of GPU-only kernels, one forward that keeps the selected layers' states, the
verifier's chunked top-k, the ids that end a turn and the target's built-in greedy
generation. extract and evaluate both use it, so eval --online sees exactly the target
extract saw.

Never writes a store, and never imports extract/, evaluate/ or train/: they depend on it,
not it on them. Its one error type is TargetError (errors.py).
"""
