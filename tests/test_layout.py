"""Where code goes (docs/architecture.md, "Layout"): the product packages hold only what the three
services run. They never import the tools (`train`, `bench`, `dflash` - but `dflash.v1`, the
generated protocol code built from proto/), they read no environment variable outside a short
list of documented settings, and their functions stay readable (at most 60 lines, argument
parsing aside)."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("runtime", "services", "gateway")
TOOLS = ("train", "bench", "dflash")
# the environment a product module may read, and why
ENVIRONMENT = {
    "services/common/flags.py": "every flag also reads DFLASH_<FLAG>",
    "runtime/home.py": "DFLASH_HOME, the models home",
    "runtime/layers/fused.py": "DFLASH_TORCH_LAYER_OPS: the torch code instead of the Triton "
                               "kernels on CUDA (same results; a suspected kernel bug)",
    "services/__init__.py": "GOMP_SPINCOUNT default for the OpenMP pool",
    "runtime/batch_invariance.py": "TRITON_INTERPRET (Triton's own): --deterministic runs on "
                                   "the CPU only under Triton's interpreter (the tests)",
}
MAX_FUNCTION_LINES = 60
ARGUMENT_PARSING = ("parse_args", "add_arguments", "add_model_service_flags", "add_server_flags",
                    "add_flags")


def product_files() -> Iterator[Path]:
    for package in PRODUCT:
        yield from sorted((REPO / package).rglob("*.py"))


def imported_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def is_tool(module: str) -> bool:
    top = module.split(".")[0]
    return top in TOOLS and not (module == "dflash.v1" or module.startswith("dflash.v1."))


def test_there_are_product_files_to_check():
    assert len(list(product_files())) > 50


@pytest.mark.parametrize("path", list(product_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_product_code_never_imports_the_tools(path):
    tree = ast.parse(path.read_text(), str(path))
    tools = sorted({m for m in imported_modules(tree) if is_tool(m)})
    assert not tools, f"{path.relative_to(REPO)} imports {tools}: product code may not import " \
                      f"{TOOLS} (only dflash.v1, the generated protocol)"


def test_product_code_reads_only_the_documented_environment():
    readers = set()
    for path in product_files():
        text = path.read_text()
        if "os.environ" in text or "getenv" in text:
            readers.add(str(path.relative_to(REPO)))
    assert readers <= set(ENVIRONMENT), f"undocumented environment readers: " \
                                        f"{sorted(readers - set(ENVIRONMENT))}"


def long_functions(path: Path) -> Iterator[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and node.name not in ARGUMENT_PARSING:
                yield node.name, lines


def test_product_functions_fit_on_a_screen():
    too_long = [f"{p.relative_to(REPO)}:{name} ({n} lines)"
                for p in product_files() for name, n in long_functions(p)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_the_tools_do_not_live_in_product_packages():
    """Training, model preparation, the launcher and benchmark switches moved out (issue 31)."""
    for gone in ("services/draft/training", "runtime/prepare", "gateway/launcher.py",
                 "gateway/demo.py", "services/draft/make_random.py", "runtime/bench_switches.py"):
        assert not (REPO / gone).exists(), f"{gone} belongs under train/ or dflash/"


def test_the_gateway_does_not_import_torch():
    """The gateway runs no model: importing torch cost it about 190 MiB of resident memory and
    a slower start (it came in through the sampling limits, the draft tree and the codec's
    dtype table, which are torch-free modules of their own now)."""
    import subprocess
    import sys
    code = "import sys, gateway.__main__; print(sorted(m for m in sys.modules if m == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
