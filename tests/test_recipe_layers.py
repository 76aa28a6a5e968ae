"""The recipe's modules depend one way: from the commands down to the config, never back up; and nothing
below the recipe (runtime, models, data, parallel, plan...) imports it.

Why a test: a helper that reaches back up into the training loop or the command line (as the launcher once
imported the loop's private config check) ties the layers together, and the next change to the loop breaks
the launcher. The walk is `test_imports.imports_of`'s (static; imports inside functions count).
"""

from __future__ import annotations

from test_imports import MODULES, imports_of

#: The recipe's modules by layer, lowest first. A module may import its own layer and the ones below.
LAYERS: list[set[str]] = [
    {"config_types", "config"},  # the config and every key's type
    {  # what the config says about the run, the model and its files, without building the run
        "topology",
        "lr",
        "stops",
        "preempt",
        "signals",
        "timeline",
        "run_result",
        "sources",
        "model_loading",
        "checkpoint",
        "resume",
        "runner",
        "metrics",
        "optimizer",
        "offload_figures",
    },
    {"preflight"},  # every check that needs more than the config
    {"run_data", "pipeline", "single_process", "auto", "held_out", "run_export", "dry_build"},  # its parts
    {"train"},  # the loop
    {"cli", "train_command", "agent", "__main__", "config_doc", ""},  # commands ("": the package)
]
#: Outside the recipe, only the command line may import it.
ABOVE_THE_RECIPE = {"pp_offload.__main__"}


def _layer(module: str) -> int:
    name = module.removeprefix("pp_offload.recipe").lstrip(".")
    found = [i for i, layer in enumerate(LAYERS) if name in layer]
    assert len(found) == 1, f"{module}: in {len(found)} layers of LAYERS; add it to the one that fits its job"
    return found[0]


def _recipe_modules() -> list[str]:
    return sorted(m for m in MODULES if m == "pp_offload.recipe" or m.startswith("pp_offload.recipe."))


def test_every_recipe_module_has_a_layer() -> None:
    for module in _recipe_modules():
        _layer(module)


def test_no_recipe_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module in _recipe_modules()
        for target in sorted(imports_of(module, lazy=True))
        if target.startswith("pp_offload.recipe") and _layer(target) > _layer(module)
    ]
    assert upward == []


def test_nothing_below_the_recipe_imports_it() -> None:
    below = [
        f"{module} imports {target}"
        for module in sorted(MODULES)
        if not module.startswith("pp_offload.recipe") and module not in ABOVE_THE_RECIPE
        for target in sorted(imports_of(module, lazy=True))
        if target.startswith("pp_offload.recipe")
    ]
    assert below == []
