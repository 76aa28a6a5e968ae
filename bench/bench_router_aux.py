"""The MoE router aux loss through pipeline stages: exactness, microbatch semantics, and its traffic.

1. exactness: tiny MoE models of several families (random fp32 weights, ``router_aux_loss_coef`` 0.5),
   one microbatch, chained stages (2, 3, 4 stages) against transformers' own ``loss`` (cross entropy +
   coef x aux): largest relative difference of the loss, the aux loss and any parameter's gradient.
2. semantics: the pipeline computes the aux loss per microbatch (as transformers does per forward, and as
   gradient accumulation does); one forward of the whole batch gives another value, since the aux loss
   is a product of two means over the forward's tokens. For m microbatches of a fixed global batch, the
   relative difference of the aux loss and of its gradient on the routers (aux alone, relative to its
   largest entry) between the whole batch and the mean over microbatches. Random routers scaled by 8
   (sharper routing); routing is still close to balanced (aux ~2.005, where 2.0 is perfectly balanced
   top-2), so the aux gradient is mostly what the microbatches' counts deviate from balance: small, and
   relatively very different between one forward and several. The numbers illustrate that the two
   objectives differ; how much depends on the routing statistics of a real model and batch.
3. traffic: bytes of the running router sums per microbatch and stage boundary against the hidden states
   they travel with, for real configurations (bf16 hidden states, one sequence per microbatch).

    python bench/bench_router_aux.py          # ~10 s on one core

Writes bench/results/router_aux.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

from pp_offload.models import IGNORE_INDEX, TokenCrossEntropy, chain_stages, split_model
from pp_offload.models.sweep import tiny_model

COEF = 0.5
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "jetmoe")
REAL = {  # name: (num_experts, hidden_size)
    "Mixtral-8x7B": (8, 4096),
    "Qwen3-30B-A3B": (128, 2048),
    "DeepSeek-style 256 experts": (256, 7168),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


def exactness() -> list[dict]:
    rows = []
    for family in FAMILIES:
        torch.manual_seed(0)
        model = tiny_model(family, output_router_logits=True, router_aux_loss_coef=COEF).train()
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
        layers = model.config.num_hidden_layers
        for stages in sorted({2, 3, 4} & set(range(2, layers + 1))):
            split = split_model(model, num_stages=stages, stage_indices=list(range(stages)), verify=False)
            loss_fn = TokenCrossEntropy(router_aux_weight=split.router_aux.coef)  # JetMoE: aux_loss_coef
            loss_fn.num_target_tokens = int((labels != IGNORE_INDEX).sum())
            logits, aux = chain_stages([split.stages[s] for s in range(stages)], ids)
            loss = loss_fn((logits, aux), labels)
            loss.backward()
            grad_rel = max(_rel(p.grad, want[n]) for n, p in model.named_parameters() if n in want)
            model.zero_grad(set_to_none=True)
            rows.append(
                {
                    "family": family,
                    "stages": stages,
                    "loss_rel": abs(float(loss.detach()) - float(out.loss.detach()))
                    / float(out.loss.detach()),
                    "aux_rel": abs(float(aux.detach()) - float(out.aux_loss.detach()))
                    / float(out.aux_loss.detach()),
                    "grad_rel": grad_rel,
                }
            )
    return rows


def semantics(batch: int = 8, seq: int = 64) -> list[dict]:
    torch.manual_seed(0)
    model = tiny_model(
        "mixtral",
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        hidden_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
    ).train()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)  # sharper routing than at initialisation
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    routers = [layer.mlp.gate.weight for layer in model.model.layers]

    def aux_and_grads(m: int) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in ids.tensor_split(m):
            aux = model(input_ids=chunk, use_cache=False).aux_loss / m
            aux.backward()
            total += float(aux.detach())
        return total, torch.cat([w.grad.flatten() for w in routers])

    whole, whole_grad = aux_and_grads(1)
    rows = []
    for m in (1, 2, 4, 8):
        value, grad = aux_and_grads(m)
        rows.append(
            {
                "microbatches": m,
                "rows_per_microbatch": batch // m,
                "aux_whole_batch": whole,
                "aux_mean_of_microbatches": value,
                "aux_rel_diff": abs(value - whole) / whole,
                "router_grad_rel_diff": _rel(grad, whole_grad),
            }
        )
    return rows


def traffic(seq: int = 4096) -> list[dict]:
    rows = []
    for name, (experts, hidden) in REAL.items():
        extra = 2 * (experts + 1) * 4
        hidden_bytes = seq * hidden * 2
        rows.append(
            {
                "model": name,
                "experts": experts,
                "extra_bytes": extra,
                "hidden_bytes": hidden_bytes,
                "extra_fraction": extra / hidden_bytes,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    exact, sem, traf = exactness(), semantics(), traffic()
    print("1. chained stages vs transformers' loss (one microbatch, fp32): largest relative differences")
    print(f"{'family':<12}{'stages':>7}{'loss':>11}{'aux':>11}{'grads':>11}")
    for r in exact:
        print(
            f"{r['family']:<12}{r['stages']:>7}{r['loss_rel']:>11.1e}{r['aux_rel']:>11.1e}{r['grad_rel']:>11.1e}"
        )
    print(
        "\n2. aux loss of the whole batch (8 x 64 tokens) vs mean over m microbatches (what the pipeline and"
    )
    print("   gradient accumulation compute); Mixtral-like, 4 layers, 8 experts, top-2, routers x8")
    print(f"{'m':>3}{'rows/mb':>9}{'aux whole':>11}{'aux mean':>11}{'aux rel':>10}{'router grad rel':>17}")
    for r in sem:
        print(
            f"{r['microbatches']:>3}{r['rows_per_microbatch']:>9}{r['aux_whole_batch']:>11.5f}"
            f"{r['aux_mean_of_microbatches']:>11.5f}{r['aux_rel_diff']:>10.2e}{r['router_grad_rel_diff']:>17.2e}"
        )
    print("\n3. extra traffic per microbatch and stage boundary (each way), seq 4096, bf16 hidden states")
    print(f"{'model':<28}{'experts':>8}{'router sums':>13}{'hidden':>12}{'fraction':>11}")
    for r in traf:
        print(
            f"{r['model']:<28}{r['experts']:>8}{r['extra_bytes']:>11} B{r['hidden_bytes'] / 2**20:>8.0f} MiB"
            f"{r['extra_fraction']:>11.1e}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "router_aux.json"
    path.write_text(json.dumps({"exactness": exact, "semantics": sem, "traffic": traf}, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
