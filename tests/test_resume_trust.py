"""Loading a checkpoint runs no code from it (docs/reliability.md, "What a resume trusts"): a tampered RNG
file is refused in one line before anything of the checkpoint is used, corrupt JSON files are named, and
no loader in pp_offload/ that reads a user-reachable path can unpickle arbitrary objects."""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from pp_offload.recipe.checkpoint import (
    CheckpointReadError,
    check_rng_files,
    latest_step,
    load_checkpoint,
    read_rng_state,
    save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PACKAGE = Path(__file__).resolve().parents[1] / "pp_offload"


class _Payload:
    """Unpickled by a loader that runs code, this creates the marker file (os.system: any command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _tamper(path: Path, marker: Path) -> None:
    with path.open("wb") as f:  # protocol 2, as torch writes its own pickles
        pickle.dump({"cpu": _Payload(marker)}, f, protocol=2)


def _saved(root: Path, steps: tuple[int, ...] = (1,)) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in steps:
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        save_checkpoint(root, step, model, optimizer)
    return model, optimizer


def test_a_tampered_rng_file_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """The issue's case: rng_0.pt replaced by a pickle that would create a marker file. Resume refuses it
    in one line naming the file (exit code 2), the marker is never created, the model is untouched, and
    the older checkpoint is named as the way on."""
    marker = tmp_path / "marker"
    root = tmp_path / "checkpoints"
    model, optimizer = _saved(root, steps=(1, 2))
    _tamper(root / "step_00000002" / "rng_0.pt", marker)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # differs from the checkpoint: a load would change it back
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointReadError) as caught:
        load_checkpoint(root, model, optimizer)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert re.search(
        r"step_00000002/rng_0\.pt: refused, not a plain RNG state .*GLOBAL posix\.system", message
    )
    assert "resume from " in message and "step_00000001" in message
    assert not marker.exists()
    assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())  # nothing of it used
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointReadError, match="rng_0.pt: refused"):  # the launcher's check, too
        check_rng_files(root, 2)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"PK\x03\x04truncated", r"refused, not a plain RNG state .*RuntimeError"),
        (None, r"refused, not an RNG state \(expected \{'cpu': a \(\d+,\) uint8 tensor\}\)"),
    ],
)
def test_a_corrupt_or_foreign_rng_file_is_named(tmp_path: Path, content: bytes | None, why: str) -> None:
    path = tmp_path / "rng_0.pt"
    if content is None:
        torch.save({"cpu": torch.zeros(3)}, path)  # loads as tensors, but is not an RNG state
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointReadError, match=re.escape(str(path)) + ": " + why):
        read_rng_state(path)


def test_an_untampered_checkpoint_restores_the_random_state(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    model, optimizer = _saved(root)
    expected = torch.rand(3)  # save_checkpoint stored the state before this draw
    torch.rand(5)
    assert load_checkpoint(root, model, optimizer) == 1
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        (
            "latest.json",
            "{not json",
            r"latest\.json is unreadable \(JSONDecodeError: .*\); delete it or point",
        ),
        (
            "latest.json",
            '{"step": "../../etc"}',
            r"latest\.json is unreadable \(ValueError: step '\.\./\.\./etc'",
        ),
        ("latest.json", "[1, 2]", r"latest\.json is unreadable \(TypeError: "),
        ("meta.json", '["a list"]', r"meta\.json is not a checkpoint's meta\.json"),
        ("meta.json", "{truncated", r"meta\.json is missing or unreadable \(JSONDecodeError"),
    ],
)
def test_a_corrupt_pointer_or_meta_file_is_one_line_naming_it(
    tmp_path: Path, name: str, text: str, why: str
) -> None:
    from pp_offload.recipe.checkpoint import checkpoint_meta

    root = tmp_path / "checkpoints"
    _saved(root)
    path = root / name if name == "latest.json" else root / "step_00000001" / name
    path.write_text(text)
    with pytest.raises(CheckpointReadError, match=why) as caught:
        latest_step(root) if name == "latest.json" else checkpoint_meta(root)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_corrupt_auto_json_is_ignored_with_a_warning_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pp_offload.recipe.auto import _recorded_decision

    recorded = tmp_path / "auto.json"
    recorded.write_text('{"decision": {"schedule": "x", "no_such_field": 1}}')
    assert _recorded_decision(recorded, {"pp": 2, "dp": 1}) is None
    out = capsys.readouterr().out
    assert f"auto: warning: ignoring {recorded} (TypeError: " in out and "probing again" in out


# Loaders that can run code from the file they read: what the scan below forbids in pp_offload/.
_UNSAFE = [
    (re.compile(r"weights_only\s*=\s*False"), "torch.load(weights_only=False) unpickles anything"),
    (re.compile(r"\bpickle\.load\s*\("), "pickle.load of a file runs what the file says"),
    (re.compile(r"\b(?:cloudpickle|dill|joblib)\.load\b"), "a pickle-based loader"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy's pickled object arrays"),
    (re.compile(r"\bread_pickle\s*\("), "pandas.read_pickle"),
    (
        re.compile(r"\byaml\.(?:unsafe_)?load\s*\((?![^)]*Loader=_yaml_loader)"),
        "yaml.load without SafeLoader",
    ),
    (re.compile(r"trust_remote_code\s*=\s*True"), "transformers running a repository's code"),
]
_TORCH_LOAD = re.compile(r"\btorch\.load\s*\(([^)]*)\)")


def test_no_loader_in_the_package_can_run_code_from_a_file() -> None:
    """Every torch.load passes weights_only=True; no pickle.load, weights_only=False, unsafe YAML or remote
    code anywhere in pp_offload/. (pickle.loads of local_ranks.py's own pipes between a parent and the ranks
    it forked reads no file and is allowed.)"""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for pattern, why in _UNSAFE:
            found += [f"{path.relative_to(PACKAGE)}: {m.group(0)} ({why})" for m in pattern.finditer(text)]
        for m in _TORCH_LOAD.finditer(text):
            if not re.search(r"weights_only\s*=\s*True", m.group(1)):
                found.append(
                    f"{path.relative_to(PACKAGE)}: {m.group(0)} (torch.load without weights_only=True)"
                )
    assert not found, "\n".join(found)
    assert "weights_only=True" in (PACKAGE / "recipe" / "checkpoint.py").read_text()  # the scan sees it


def test_the_scan_catches_what_it_forbids() -> None:
    """The patterns match the forms they are for (a scan that matches nothing would pass forever)."""
    samples = [
        "torch.load(path, weights_only=False)",
        "pickle.load(f)",
        "joblib.load(p)",
        "np.load(p, allow_pickle=True)",
        "pd.read_pickle(p)",
        "yaml.load(text)",
        "AutoModel.from_pretrained(p, trust_remote_code=True)",
    ]
    assert all(any(p.search(s) for p, _ in _UNSAFE) for s in samples)
    assert not any(p.search("yaml.load(text, Loader=_yaml_loader())") for p, _ in _UNSAFE)
    assert not any(p.search("pickle.loads(payload)") for p, _ in _UNSAFE)
    bare = _TORCH_LOAD.search("torch.load(rng)")
    assert bare is not None and "weights_only=True" not in bare.group(1)


def test_meta_records_the_layout_and_a_json_pointer(tmp_path: Path) -> None:
    """What a resume reads is JSON: latest.json and meta.json parse with json alone."""
    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(root, 3, model, optimizer, meta={"layout": {"pp": 2, "dp": 1}})
    assert json.loads((root / "latest.json").read_text()) == {"step": 3, "dir": "step_00000003"}
    assert json.loads((root / "step_00000003" / "meta.json").read_text())["layout"] == {"pp": 2, "dp": 1}
