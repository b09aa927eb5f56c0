"""`dflash eval`'s outputs stay what they were: the report JSON, the printed table and the
per-block parquet rows of fixed runs (offline --mode replay and all, --online) on the tiny
regenerated store, equal to the copies recorded in golden/ before the eval modes were put
behind one interface (issue 29). Paths are replaced by placeholders, nothing else.

Rerecord (only when a change of the numbers is intended, and say so in the commit):
DFLASH_RECORD_EVAL_GOLDEN=1 pytest tests/evaluate/test_report_identity.py
"""

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_train.drafter import save_drafter
from dflash_train.evaluate.config import EvalSettings
from dflash_train.evaluate.pipeline import EvalConfig, run_eval
from dflash_train.train.config import ModelConfig
from dflash_train.train.drafter_shape import initial_drafter

GOLDEN = Path(__file__).with_name("golden")
RECORD = os.environ.get("DFLASH_RECORD_EVAL_GOLDEN") == "1"
"""Write the golden copies instead of comparing with them."""

CASES = {
    "offline_replay": dict(settings=EvalSettings(mode="replay", tree_budgets=(4, 16),
                                                 position_bin=16), show=2),
    "offline_all": dict(settings=EvalSettings(mode="all", tree_budgets=(2, 8),
                                              recall_at=(1, 3))),
    "online_replay": dict(settings=EvalSettings(mode="replay", tree_budgets=(4,),
                                                position_bin=16), online=True),
    "online_all": dict(settings=EvalSettings(mode="all", tree_budgets=(4,)), online=True),
}


def placeholders(text: str, paths: dict[str, str]) -> str:
    """`text` with each path (longest first) replaced by its name."""
    for path, name in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(str(Path(path).resolve()), name).replace(path, name)
    return text


def outputs(out, out_dir: Path, paths: dict[str, str]) -> dict:
    """What a run printed and wrote, paths as placeholders, in a JSON-ready dict."""
    written = (out_dir / "report.json").read_text()
    assert written == json.dumps(out.report, indent=2) + "\n"  # --json prints the same
    blocks = pq.read_table(out_dir / "blocks.parquet").to_pydict()
    return {"report": json.loads(placeholders(written, paths)),
            "text": placeholders(out.text, paths).splitlines(),
            "blocks": blocks}


def check_or_record(name: str, got: dict) -> None:
    path = GOLDEN / f"{name}.json"
    if RECORD:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        return
    want = json.loads(path.read_text())
    got = json.loads(json.dumps(got))  # tuples as lists, as the golden copy holds them
    for part in ("report", "text", "blocks"):
        assert got[part] == want[part], f"{name}: {part} differs from golden/{name}.json"


@pytest.fixture(scope="module")
def warm_drafter_dir(tmp_path_factory, trained_drafter_dir) -> str:
    """A DFlash 2 drafter (no tree figures) warm-started from the trained one."""
    warm = initial_drafter(ModelConfig(kind="dflash2", init_from=trained_drafter_dir,
                                       selector_rank=8, selector_top_k=4, conv_kernel_size=3))
    return str(save_drafter(warm, tmp_path_factory.mktemp("warm") / "warm"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_outputs_equal_the_recorded_ones(case, tmp_path, regen_store, eos_target_dir,
                                              trained_drafter_dir, random_drafter_dir,
                                              warm_drafter_dir):
    options = dict(CASES[case])
    online = options.pop("online", False)
    checkpoints = [trained_drafter_dir, random_drafter_dir]
    if not online:  # the live loop is slow; the DFlash 2 walk is covered offline
        checkpoints.append(warm_drafter_dir)
    out_dir = tmp_path / "eval"
    cfg = EvalConfig(store=regen_store, checkpoints=checkpoints, progress=False,
                     out=str(out_dir), online=online, model=eos_target_dir if online else None,
                     **options)
    out = run_eval(cfg, echo=lambda _: None)
    paths = {regen_store: "<store>", eos_target_dir: "<target>", trained_drafter_dir:
             "<trained>", random_drafter_dir: "<rand>", warm_drafter_dir: "<warm>"}
    check_or_record(case, outputs(out, out_dir, paths))
