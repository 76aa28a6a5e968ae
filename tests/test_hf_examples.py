"""Smoke tests of hf_examples/: each script with --tiny on 2 CPU ranks, launched as a user launches it
(torchrun; the GPT-2 one also through accelerate launch with recipes/accelerate_cpu.yaml). Every run must
exit 0 and export a model that transformers loads; the SFT data must mask exactly the prompt tokens."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as sock:  # torchrun's --master-port 0 hangs; ask the OS for a free port instead
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(launcher: list[str], script: str, out: Path, steps: int = 2) -> str:
    """Run ``launcher script --tiny`` from the repository root; kill its whole process group on a timeout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [*launcher, f"hf_examples/{script}", "--tiny", "--steps", str(steps), "--output-dir", str(out)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its rank processes
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT} s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def _torchrun() -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
    ]


def _check_export(out: Path, model_type: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "export").eval()
    assert model.config.model_type == model_type
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 16, model.config.vocab_size) and torch.isfinite(logits).all()


def test_sft_llama_tiny_masks_prompts(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pp_offload.data import IGNORE_INDEX, DataConfig, load_examples, pack_examples

    out = tmp_path / "sft"
    output = _launch(_torchrun(), "sft_llama.py", out)
    assert "sft: loss" in output
    _check_export(out, "llama")

    # The data the run trained on: template-wrapped prompts, packed as the recipe packs them.
    tokenizer = AutoTokenizer.from_pretrained(out / "export")
    config = DataConfig(
        path=str(out / "sft_data.jsonl"), prompt_column="prompt", response_column="response", seq_len=64
    )
    examples = load_examples(config, cache_dir=tmp_path / "cache")
    assert len(examples) == 300 and examples[0]["prompt"].startswith("### Instruction:\n")
    packed = pack_examples(examples, tokenizer, config)

    # Expected labels, built independently: targets are learned iff they are response tokens or the eos.
    stream, learned = [], []
    for row in examples:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        stream += [*prompt, *response, tokenizer.eos_token_id]
        learned += [False] * len(prompt) + [True] * (len(response) + 1)
    blocks = min(len(packed), 20)
    for b in range(blocks):
        start = b * 64
        want = [stream[i + 1] if learned[i + 1] else IGNORE_INDEX for i in range(start, start + 64)]
        assert packed[b]["input_ids"] == stream[start : start + 64]
        assert packed[b]["labels"] == want
    # and read back as text: the learned targets never contain the template, the masked ones do
    labels = [t for b in range(blocks) for t in packed[b]["labels"]]
    inputs = [t for b in range(blocks) for t in packed[b]["input_ids"]]
    learned_text = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    masked_text = tokenizer.decode(
        [inputs[i + 1] for i in range(len(labels) - 1) if labels[i] == IGNORE_INDEX]
    )
    assert "### Instruction" not in learned_text and "### Response" not in learned_text
    assert "### Instruction" in masked_text and "Explain the Python help topic" in masked_text
    assert 0.1 < sum(t == IGNORE_INDEX for t in labels) / len(labels) < 0.9


def test_continued_pretraining_gpt2_tiny(tmp_path: Path) -> None:
    output = _launch(_torchrun(), "continued_pretraining_gpt2.py", tmp_path / "gpt2")
    assert "cpt: loss" in output
    _check_export(tmp_path / "gpt2", "gpt2")


def test_accelerate_cpu_config_launches_two_ranks(tmp_path: Path) -> None:
    """recipes/accelerate_cpu.yaml starts 2 gloo ranks like torchrun (MULTI_GPU launcher, use_cpu)."""
    pytest.importorskip("accelerate")
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "accelerate_cpu.yaml"),
    ]  # its main_process_port 0: a free port
    output = _launch(launcher, "continued_pretraining_gpt2.py", tmp_path / "acc")
    assert "cpt: loss" in output
    summary = json.loads((tmp_path / "acc" / "summary.json").read_text())
    assert summary["schedule"] == "ScheduleVZB"  # pipelined: one process would run "single process"
    _check_export(tmp_path / "acc", "gpt2")
