"""The package's layering, read from its import graph: each module imports only modules in the layers below it
(the order of LAYERS, the same as the package docstring's), so no cycle and no upward import can creep in. Every
import counts, at the top of a module or inside a function. The package's size is held here too."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from conftest import ROOT

PACKAGE = ROOT / "switchboard"

# Lowest first. A module may import any module listed before it, never one after it.
LAYERS = [
    "configuration", "tracing", "migrations", "database", "crypto", "postgres", "engines", "engine_copy", "payload", "providers", "models", "envelope", "evaluator",
    "store.principals", "store.outbox", "store.todos", "store.wait_limits", "store.admission", "store.outputs", "store.forge_outbox",
    "store.transitions", "store.queues", "store.webhooks", "store.connections", "store.human_actions", "store.bulk",
    "store.subjects", "store.forge_control", "store.deliveries", "store.rules", "store.routing", "store.quarantine", "store.replay",
    "store.schedules", "store.wait_sweep", "store.upkeep",
    "doorbell", "notifier", "forge", "limits", "metrics", "flows",
    "http.common", "http.streams", "http.rest", "http.mcp",
    "board.queries", "board.forge_pages", "board.pages", "app", "server",
    "worker.job", "worker.tracing", "worker.park", "worker.api", "worker.exec_runner", "worker.triage", "worker.loop", "worker.main",
    "cli.output", "cli.commands", "cli.forge_commands", "cli.parser", "cli.entry",
]
# Package markers (docstrings only) and the entry point, which sits above everything.
OUTSIDE_THE_LAYERS = {"__init__", "store.__init__", "http.__init__", "board.__init__", "cli.__init__", "__main__",
                      "worker.__init__", "worker.__main__"}
MAX_MODULE_LINES = 1500


def module_names() -> list[str]:
    return sorted(".".join(path.relative_to(PACKAGE).with_suffix("").parts) for path in PACKAGE.rglob("*.py"))


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports, wherever in it the import statement stands."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("switchboard."):
            target = node.module.removeprefix("switchboard.")
            # `from switchboard.store import todos` names a module; `from switchboard.store.todos import x` a name.
            found |= {f"{target}.{alias.name}" for alias in node.names
                      if f"{target}.{alias.name}" in LAYERS} or {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("switchboard.") for alias in node.names
                      if alias.name.startswith("switchboard.")}
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of `graph` (module -> the modules it imports) that does not point strictly down LAYERS."""
    rank = {name: index for index, name in enumerate(LAYERS)}
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target not in rank:
                wrong.append(f"{module} imports {target}, which has no place in LAYERS")
            elif rank[target] >= rank[module]:
                wrong.append(f"{module} imports {target}, which is not below it")
    return wrong


def test_every_module_has_a_layer():
    unplaced = [m for m in module_names() if m not in LAYERS and m not in OUTSIDE_THE_LAYERS]
    assert not unplaced, f"add these to LAYERS (and the package docstring): {unplaced}"


def test_every_import_points_down_the_layers():
    graph = {m: imports_of(m) for m in module_names() if m in LAYERS}
    assert upward_imports(graph) == []


def test_the_check_catches_an_upward_import_and_a_cycle():
    """The checker itself: a store module reaching up into HTTP, and two modules importing each other."""
    assert upward_imports({"store.todos": {"http.rest"}}) == ["store.todos imports http.rest, which is not below it"]
    cycle = upward_imports({"limits": {"metrics"}, "metrics": {"limits"}})
    assert cycle == ["limits imports metrics, which is not below it"]


def test_the_store_knows_nothing_of_http():
    """The store is transaction bodies over a connection: the seam another storage engine plugs into."""
    for module in (m for m in module_names() if m.startswith("store.")):
        source = PACKAGE.joinpath(*module.split(".")).with_suffix(".py").read_text()
        for word in ("starlette", "uvicorn", "httpx", "switchboard.http", "switchboard.board"):
            assert word not in source, f"{module} mentions {word}"


def test_the_worker_shares_no_code_with_the_server():
    """The client side is a worker like any third party's: its modules import only one another."""
    for module in (m for m in module_names() if m.startswith("worker.") and m in LAYERS):
        outside = sorted(target for target in imports_of(module) if not target.startswith("worker."))
        assert not outside, f"{module} imports {outside}"


def test_the_worker_command_starts_without_the_servers_modules():
    """`switchboard worker` goes to the worker's parser before the operator's commands (the store and its models)
    are imported: they were a third of a worker's start-up."""
    code = ("import sys\nfrom switchboard.cli.entry import main\ntry:\n    main(['worker', '--help'])\n"
            "except SystemExit:\n    pass\nprint(' '.join(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "--server" in done.stdout, done.stdout + done.stderr
    loaded = done.stdout.split()
    server_side = sorted(m for m in loaded if m.startswith("switchboard.") and
                         not m.startswith("switchboard.worker") and m not in ("switchboard.cli", "switchboard.cli.entry"))
    assert "switchboard.worker.main" in loaded and not server_side, server_side


def test_an_operators_command_starts_without_the_event_loop_and_a_server_without_the_otlp_sdk(tmp_path):
    """A command such as `human list` imports neither asyncio nor the server's modules, and a server with no OTLP
    endpoint set imports nothing of the OpenTelemetry SDK: each was tens of milliseconds of every start, and a
    test suite starts hundreds of them."""
    code = ("import sys\nfrom switchboard.cli.entry import main\npath = sys.argv[1]\n"
            "assert main(['init', '--db', path, '--json']) == 0 and main(['human', 'list', '--db', path]) == 0\n"
            "cli = sorted(sys.modules)\nfrom switchboard.tracing import start_tracing\n"
            "assert start_tracing({}) is None\nprint(' '.join(cli))\nprint(' '.join(sorted(sys.modules)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sb.db")], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    cli, after = (line.split() for line in done.stdout.splitlines()[-2:])
    assert "switchboard.store.principals" in cli, cli
    assert not [m for m in cli if m == "asyncio" or m in ("switchboard.server", "switchboard.app", "uvicorn")], cli
    assert not [m for m in after if m.startswith("opentelemetry")], after


def test_no_module_imports_another_modules_private_names():
    """A name another module imports is part of its module's interface, so it has a public name."""
    private = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("switchboard"):
                private += [f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}"
                            for alias in node.names if alias.name.startswith("_")]
    assert not private, private


def test_no_module_is_over_the_size_limit():
    sizes = {m: len(PACKAGE.joinpath(*m.split(".")).with_suffix(".py").read_text().splitlines())
             for m in module_names()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, max(sizes.items(), key=lambda item: item[1])
