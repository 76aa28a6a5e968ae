"""Data at scale: preparation speed, memory per rank and of the launcher, time to the first step (cold, warm).

For each row count, generated supervised fine-tuning rows of about 100 bytes (a prompt and a response of
random words) are written as JSON Lines, then:

- preparation: `pp_offload.data.prepared.prepare` in a fresh process with an already-trained tokenizer (the
  embedded corpus's byte-level BPE) into an empty cache: seconds, rows/s, that process's peak RSS, and
  the CPU seconds it and its tokenizing processes used (rows per CPU-second: what a loaded machine's wall
  time hides);
- a cold run: ``pp-offload train --nproc-per-node 2`` (a tiny Llama, 2 pipeline ranks on CPU, a few steps)
  with an empty ``data.cache_dir``: time from the launch to the first step's log line, each rank's peak RSS
  (VmHWM) and the launcher's RSS while the ranks train (sampled);
- a warm run: the same data and cache, a new output directory;
- streaming (``data.streaming``): seconds from the stream's opening to the first global batch, and to a
  resume's first batch at ``--resume-step`` (rows re-read per second).

    python bench/bench_data.py                       # 10k, 100k and 1M rows
    python bench/bench_data.py --rows 10000 --steps 2
    python bench/bench_data.py --parts stream       # data.streaming: first batch, resume cost

Writes bench/results/data.json (or --out) and prints a table (the one in docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the a model pipeline stage rank learns loss falls data token shard offload memory host device batch "
    "step schedule gradient layer weight optimizer checkpoint resume tokenizer block stream cache"
).split()

PREPARE = """
import json, resource, sys, time
from pp_offload.data import DataConfig, load_examples
from pp_offload.data.prepared import prepare
from transformers import AutoTokenizer
file, tokenizer, cache = sys.argv[1:4]
config = DataConfig(path=file, prompt_column="prompt", response_column="response", seq_len=128)
tok = AutoTokenizer.from_pretrained(tokenizer)
def cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
start, cpu_start = time.perf_counter(), cpu()
prepared = prepare(config, tok, lambda: load_examples(config, cache_dir=cache), cache_dir=cache)
seconds, cpu_s = time.perf_counter() - start, cpu() - cpu_start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "blocks": len(prepared.blocks), "rows": prepared.info["rows"],
                  "num_proc": prepared.info["num_proc"], "peak_rss_mib": peak,
                  "peak_rss_workers_mib": children, "cpu_s": cpu_s}))
"""


STREAM = """
import json, resource, sys, time
start = time.perf_counter()
from pp_offload.data import DataConfig, load_examples
from pp_offload.data.streaming import StreamingBatches
from transformers import AutoTokenizer
file, tokenizer, cache, skip = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
config = DataConfig(path=file, prompt_column="prompt", response_column="response", seq_len=128,
                    streaming=True)
tok = AutoTokenizer.from_pretrained(tokenizer)
imported = time.perf_counter()
batches = StreamingBatches(lambda: load_examples(config, cache_dir=cache), tok, config, 16)
batches.batch(0)
first = time.perf_counter()
resumed = StreamingBatches(lambda: load_examples(config, cache_dir=cache), tok, config, 16)
resumed.batch(skip)
skipped = time.perf_counter()
print(json.dumps({"imports_s": imported - start, "first_batch_s": first - imported,
                  "resume_step": skip, "resume_s": skipped - first, "rows_skipped": resumed.skipped_rows,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_rows(path: Path, rows: int, seed: int = 0) -> int:
    """``rows`` JSON lines of about 100 bytes each; returns the file's size."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(5))
            response = " ".join(rng.choice(WORDS) for _ in range(6))
            f.write(json.dumps({"prompt": f"{i}: {prompt}?", "response": response}) + "\n")
    return path.stat().st_size


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def prepare_once(file: Path, tokenizer: Path, cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PREPARE, str(file), str(tokenizer), str(cache)],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def stream_once(file: Path, tokenizer: Path, cache: Path, skip: int) -> dict:
    """``data.streaming``: seconds to the first global batch (after imports) and to resume at ``skip``."""
    out = subprocess.run(
        [sys.executable, "-c", STREAM, str(file), str(tokenizer), str(cache), str(skip)],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status(pid: int, key: str) -> float | None:
    """A /proc/<pid>/status memory line (VmRSS, VmHWM) in MiB, or None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def train_once(file: Path, tokenizer: Path, cache: Path, out: Path, steps: int) -> dict:
    """One ``pp-offload train`` run: time to the first step, the ranks' peak RSS, the launcher's RSS while
    they train."""
    sets = {
        "model.tokenizer": str(tokenizer),
        "model.config.num_hidden_layers": "4",
        "model.config.hidden_size": "64",
        "model.config.intermediate_size": "128",
        "data.path": str(file),
        "data.prompt_column": "prompt",
        "data.response_column": "response",
        "data.eval_split": "null",
        "data.cache_dir": str(cache),
        "train.steps": str(steps),
        "train.eval_every": "0",
        "train.warmup_steps": "0",
        "output.dir": str(out),
        "output.save_every": "0",
        "output.export": "false",
        "output.log_every": "1",
    }
    command = [sys.executable, "-m", "pp_offload", "train", "--nproc-per-node", "2", "--no-progress"]
    command += ["--config", str(ROOT / "recipes" / "configs" / "tiny_llama.yaml")]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not first_step and line.startswith("step 1/"):
                first_step.append(time.perf_counter() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ranks: dict[int, float] = {}
    launcher_training: list[float] = []
    while proc.poll() is None:
        workers = []
        for child in _children(proc.pid):
            workers += [g for g in _children(child) if "pp_offload.recipe" in _cmdline(g)]
        for pid in workers:
            peak = _status(pid, "VmHWM")
            if peak is not None:
                ranks[pid] = max(ranks.get(pid, 0.0), peak)
        if workers and (rss := _status(proc.pid, "VmRSS")) is not None:
            launcher_training.append(rss)
        time.sleep(0.05)
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"pp-offload train failed ({proc.returncode}):\n{''.join(lines[-30:])}")
    return {
        "first_step_s": first_step[0] if first_step else None,
        "total_s": time.perf_counter() - start,
        "rank_peak_rss_mib": sorted(ranks.values()),
        "launcher_rss_training_mib": max(launcher_training) if launcher_training else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("prepare", "train", "stream"),
        default=["prepare", "train", "stream"],
        help="what to measure (default: all)",
    )
    parser.add_argument("--resume-step", type=int, default=1000, help="streaming: the step a resume skips to")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "data.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pp_offload.data import embedded_assets, embedded_dir

    tokenizer = embedded_assets(embedded_dir()).tokenizer_dir
    results = []
    work = Path(tempfile.mkdtemp(prefix="bench_data-"))
    try:
        for rows in args.rows:
            file = work / f"rows-{rows}.jsonl"
            size = write_rows(file, rows)
            entry: dict = {"rows": rows, "bytes": size}
            if "prepare" in args.parts:
                prep = prepare_once(file, tokenizer, work / f"prep-cache-{rows}")
                entry |= {"prepare": prep, "rows_per_s": rows / prep["seconds"]}
            if "train" in args.parts:
                cache = work / f"cache-{rows}"
                entry["cold"] = train_once(file, tokenizer, cache, work / f"cold-{rows}", args.steps)
                entry["warm"] = train_once(file, tokenizer, cache, work / f"warm-{rows}", args.steps)
            if "stream" in args.parts:
                entry["stream"] = stream_once(file, tokenizer, work / f"stream-{rows}", args.resume_step)
            results.append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    args.out.write_text(
        json.dumps({"cpus": os.cpu_count(), "loadavg_at_end": load, "results": results}, indent=2) + "\n"
    )
    print(table(results))
    return 0


def table(results: list[dict]) -> str:
    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "| rows | prepare s | rows/s | prepare peak MiB | rank peak MiB (cold / warm) | launcher MiB while "
        "training | first step s cold | first step s warm | streaming: first batch s | streaming: resume "
        "rows/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        prep, cold, warm, stream = (r.get(k, {}) for k in ("prepare", "cold", "warm", "stream"))
        ranks = " / ".join(mib(max(x["rank_peak_rss_mib"], default=None)) for x in (cold, warm) if x)
        resume = stream["rows_skipped"] / stream["resume_s"] if stream.get("resume_s") else None
        lines.append(
            f"| {r['rows']:,} | {secs(prep.get('seconds'))} | {mib(r.get('rows_per_s'))} | "
            f"{mib(prep.get('peak_rss_mib'))} | {ranks or '-'} | "
            f"{mib(cold.get('launcher_rss_training_mib'))} | {secs(cold.get('first_step_s'))} | "
            f"{secs(warm.get('first_step_s'))} | {secs(stream.get('first_batch_s'))} | {mib(resume)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
