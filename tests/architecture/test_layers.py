"""The floor plan holds: every import in minfer/ runs down the layers that docs/architecture.md draws,
and the plain core imports no feature room.

Imports are read from the source with ast, all of them: module level, inside functions and
under TYPE_CHECKING. A module may import its own package and any layer below its own; a
layer's peers (attention and text; the feature rooms; bench and stress) do not import each
other, but for the exceptions listed, each with its reason.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "minfer"

# Bottom up. A module's layer is the first entry that its dotted name starts with.
LAYERS = [
    ("base", 0, ("minfer.device_errors", "minfer.errors", "minfer.host_to_device", "minfer.model_config", "minfer.settings",
               "minfer.step_parts", "minfer.version")),
    ("attention", 1, ("minfer.attention",)),
    ("text", 1, ("minfer.text",)),
    ("models", 2, ("minfer.models",)),
    ("engine", 3, ("minfer.engine",)),
    # The feature rooms: each imports the core (the layers above) and no other room.
    ("cpu", 4, ("minfer.cpu",)),
    ("compiled", 4, ("minfer.compiled",)),
    ("quantization", 4, ("minfer.quantization",)),
    ("scoring", 4, ("minfer.scoring",)),
    ("parallel_sampling", 4, ("minfer.parallel_sampling",)),
    ("speculative", 4, ("minfer.speculative",)),
    ("structured", 4, ("minfer.structured",)),
    ("assembly", 5, ("minfer.assembly",)),
    ("checkpoints", 5, ("minfer.checkpoints",)),
    ("server", 6, ("minfer.server",)),
    ("bench", 7, ("minfer.bench",)),
    ("stress", 7, ("minfer.stress",)),
    # Training the tiny models: a room above everything it uses, which only the entry points reach.
    ("training", 8, ("minfer.training",)),
    # What users run: the package's names, the `minfer` command and the old `python -m` entry points.
    ("entry", 9, ("minfer.__init__", "minfer.__main__", "minfer.cli", "minfer.serve", "minfer.generate", "minfer.quantize",
                  "minfer.random_model")),
]
# Imports between peers that the plan allows, each with its reason: (importing layer, imported module).
ALLOWED_PEER_IMPORTS = {
    ("compiled", "minfer.cpu.features"): "which GEMMs a frozen graph may use depends on AMX",
    ("quantization", "minfer.cpu.features"): "int8's row paths follow the CPU's int8 dot products",
    ("quantization", "minfer.cpu.malloc"): "a quantizing load returns its temporaries to the OS",
    ("compiled", "minfer.cpu.tiled_attention"): "the compiled CPU backend is the tiled one with a compiled decode",
    ("compiled", "minfer.cpu.malloc"): "a package's build returns its temporaries to the OS",
    ("compiled", "minfer.cpu.huge_pages"): "a package's weights are read in 2 MB pages",
}
# The plain core: what tutorial stages 01-13 teach. None of it imports a feature room, in any form.
CORE = ("minfer.device_errors", "minfer.errors", "minfer.host_to_device", "minfer.model_config", "minfer.settings",
        "minfer.step_parts", "minfer.version", "minfer.attention", "minfer.text", "minfer.models", "minfer.engine")
ROOMS = ("minfer.cpu", "minfer.compiled", "minfer.quantization", "minfer.scoring", "minfer.parallel_sampling",
         "minfer.speculative", "minfer.structured")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts)


def layer_of(module: str) -> tuple[str, int]:
    if module == "minfer":
        module = "minfer.__init__"
    for name, rank, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name, rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def imported_modules(source: str, own: str, is_package: bool, modules: set[str]) -> list[tuple[int, str]]:
    """(line, minfer module) for every import of a minfer module in `source`, the code of module `own`."""
    package = own if is_package else own.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "minfer"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "minfer":
                continue
            for alias in node.names:  # `from . import live_view` imports a module
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in modules else target))
    return found


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    return imported_modules(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", modules)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_is_in_a_layer():
    for module in all_modules():
        layer_of(module)


def test_imports_run_down_the_layers():
    modules = all_modules()
    wrong = []
    for module, path in sorted(modules.items()):
        name, rank = layer_of(module)
        for line, target in imports_of(path, set(modules)):
            if target == "minfer":
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports the minfer package itself")
                continue
            target_name, target_rank = layer_of(target)
            if target_name != name and target_rank >= rank and (name, target) not in ALLOWED_PEER_IMPORTS:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target} ({target_name})")
    assert not wrong, "imports against the layers' directions:\n" + "\n".join(wrong)


def test_the_core_imports_no_feature_room():
    """The modules tutorials 01-13 teach never import a feature room: not at module level, not inside a
    function, not under TYPE_CHECKING. A feature attaches where the core shows it (engine/features.py)."""
    modules = all_modules()
    core = sorted(m for m in modules if within(m, CORE))
    assert "minfer.engine.scheduler" in core and "minfer.attention.paged" in core
    wrong = [
        f"{modules[m].relative_to(ROOT)}:{line}: imports {target}"
        for m in core
        for line, target in imports_of(modules[m], set(modules))
        if within(target, ROOMS) or within(target, ("minfer.assembly",))
    ]
    assert not wrong, "the core reaches into a feature room:\n" + "\n".join(wrong)


def test_only_the_entry_points_reach_the_training_room():
    """Nothing in minfer but the training room itself and the entry points imports minfer.training, and no
    tutorial does: serving, benchmarking and the tutorials run without the trainer."""
    modules = all_modules()
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: imports {target}"
        for m, path in modules.items()
        if layer_of(m)[0] not in ("training", "entry")
        for line, target in imports_of(path, set(modules))
        if within(target, ("minfer.training",))
    ]
    for path in sorted((ROOT / "tutorials").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        wrong += [f"{path.relative_to(ROOT)}:{line}: imports {target}"
                  for line, target in imported_modules(source, "tutorials", False, set(modules))
                  if within(target, ("minfer.training",))]
    assert not wrong, "the training room is imported from outside:\n" + "\n".join(wrong)
    assert "minfer.training.train_tiny" in modules  # the room is where this test looks


def test_every_allowed_exception_is_still_needed():
    modules = all_modules()
    used = {
        (layer_of(m)[0], target)
        for m, path in modules.items()
        for _, target in imports_of(path, set(modules))
    }
    stale = [f"{layer} -> {target}" for layer, target in ALLOWED_PEER_IMPORTS if (layer, target) not in used]
    assert not stale, "listed exceptions nothing uses any more: drop them\n" + "\n".join(stale)


def test_no_module_is_too_long():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines hold two concepts; split them:\n" + "\n".join(long)


def test_no_line_is_wider_than_the_project_width():
    """The code a reader reads (the package, the tutorials, the scripts) is written to pyproject's width."""
    import tomllib

    width = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["line-length"]
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tutorials").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
             ROOT / "bench.py"]
    wide = [f"{p.relative_to(ROOT)}:{i}: {len(line)} columns" for p in files
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > width]
    assert not wide, f"lines over {width} columns:\n" + "\n".join(wide)


def test_the_checker_sees_what_it_must():
    """Upward imports inside a function, under TYPE_CHECKING and of a sibling module are all found."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..assembly import llm\n"
        "def f():\n    from ..server.serve import main\n"
        "from .. import step_parts\n"
    )
    modules = set(all_modules())
    targets = sorted(t for _, t in imported_modules(source, "minfer.attention.paged", False, modules))
    assert targets == ["minfer.assembly.llm", "minfer.server.serve", "minfer.step_parts"]
