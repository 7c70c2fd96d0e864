"""What `import modular` changes in the process, against README.md's list, and the opt-outs.

Pure and single-process: one fresh interpreter (a subprocess, since the changes happen once, at
import) first imports every third-party module that modular's files import, records the state a
library can change globally, imports modular and records it again. What changed must be exactly
what README.md's "What `import modular` changes" lists, so a new global hook fails here until the
README names it. The same interpreter then tries each opt-out the README gives.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r'''
import ast, atexit, copyreg, importlib, json, logging, pathlib, signal, sys, threading, warnings

third_party = set()
for path in pathlib.Path("modular").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            third_party.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            third_party.add(node.module)
for name in sorted(third_party):
    if name.split(".")[0] not in ("modular", "planners"):
        importlib.import_module(name)

import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
import torch.serialization
import torch.utils._foreach_utils as foreach_utils
import torch.utils._pytree as pytree


def name(obj):
    return f"{obj.__module__}.{obj.__qualname__}"


def names(hooks):
    return [name(h) for h in hooks.values()]


def pattern(regex):  # a compiled filter's text; -W and PYTHONWARNINGS filters keep a string
    return getattr(regex, "pattern", regex)


def snapshot():
    s = {
        "atexit callbacks": atexit._ncallbacks(),
        "warnings filters": [
            [action, pattern(text), category.__name__, pattern(where), line]
            for action, text, category, where, line in warnings.filters
        ],
        "torch ops": sorted(torch._C._dispatch_get_all_op_names()),
        "foreach types": {
            "torch.optim.optimizer": [name(t) for t in optimizer_hooks._foreach_supported_types],
            "torch.utils._foreach_utils": [name(t) for t in foreach_utils._foreach_supported_types],
        },
        "optimizer step pre-hooks": names(optimizer_hooks._global_optimizer_pre_hooks),
        "optimizer step post-hooks": names(optimizer_hooks._global_optimizer_post_hooks),
        "module hooks": {
            k: names(getattr(module_hooks, k))
            for k in dir(module_hooks)
            if k.startswith("_global_") and isinstance(getattr(module_hooks, k), dict)
        },
        "dynamo config": repr(sorted(torch._dynamo.config.get_config_copy().items())),
        "inductor config": repr(sorted(torch._inductor.config.get_config_copy().items())),
        "safe globals": repr(torch.serialization.get_safe_globals()),
        "pytree nodes": sorted(map(repr, pytree.SUPPORTED_NODES)),
        "copyreg": sorted(map(repr, copyreg.dispatch_table)),
        "process": repr((
            sys.excepthook, threading.excepthook, sys.getprofile(), sys.gettrace(),
            [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)],
            logging.root.handlers, logging.root.level, torch.get_num_threads(),
            torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_grad_enabled(),
        )),
    }
    attributes = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and mod_name.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu"):
            for attr, value in list(vars(mod).items()):
                attributes[f"{mod_name}.{attr}"] = id(value)
    return s, attributes


# atexit cannot list its callbacks: record who registers one (its count catches any other way).
registered = []
register = atexit.register
def recording_register(fn, *args, **kwargs):
    registered.append(name(fn))
    return register(fn, *args, **kwargs)
atexit.register = recording_register
before, attributes_before = snapshot()
import modular
after, attributes_after = snapshot()
atexit.register = register

changes = {}
for key in before:
    if key in ("warnings filters", "torch ops"):
        added = [x for x in after[key] if x not in before[key]]
        # A filter added again moves to the front: the same entries, in another order of priority.
        if [x for x in after[key] if x in before[key]] != before[key]:
            added.append(f"the earlier entries changed: {after[key]}")
        if added:
            changes[key] = added
    elif key == "foreach types":
        for where in before[key]:
            added = [x for x in after[key][where] if x not in before[key][where]]
            if added or len(after[key][where]) != len(before[key][where]):
                changes.setdefault(key, {})[where] = added
    elif key == "atexit callbacks":
        if registered or after[key] != before[key]:
            others = after[key] - before[key] - len(registered)
            changes[key] = registered + ["not through atexit.register"] * others
    elif after[key] != before[key]:
        changes[key] = after[key] if key.endswith("hooks") else "changed"
replaced = sorted(
    k for k, v in attributes_after.items() if k in attributes_before and attributes_before[k] != v
)
modules_before = {k.rsplit(".", 1)[0] for k in attributes_before}
new_attributes = sorted(
    k for k in attributes_after if k not in attributes_before and k.rsplit(".", 1)[0] in modules_before
)
if replaced or new_attributes:
    changes["torch, torchrec or fbgemm attributes"] = replaced + new_attributes

# The README's opt-outs, each tried in turn.
from modular import lifecycle
from modular.compose.params import remove_optimizer_check

opt_outs = {}
table = torch.nn.Parameter(torch.ones(3))
lifecycle.retire(table, "'t0'")
table.grad = torch.ones(3)
sgd = torch.optim.SGD([table], lr=1.0)
try:
    sgd.step()
    opt_outs["optimizer check raised"] = None
except TypeError as e:
    opt_outs["optimizer check raised"] = str(e)
remove_optimizer_check()
remove_optimizer_check()
sgd.step()
opt_outs["stepped after remove_optimizer_check"] = table.tolist()
opt_outs["optimizer step pre-hooks after remove_optimizer_check"] = [
    name(h) for h in optimizer_hooks._global_optimizer_pre_hooks.values()
]


message = (
    "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered to the "
    "Autograd key(s)"
)
with warnings.catch_warnings(record=True) as shown:
    warnings.warn(message, UserWarning)
    opt_outs["warnings shown while filtered"] = len(shown)
    warnings.filterwarnings("default", message="fbgemm::dense_embedding_codegen_lookup_function")
    warnings.warn(message, UserWarning)
    opt_outs["warnings shown after the opt-out"] = len(shown)

# Last, as at exit: run the atexit callbacks left after the README's opt-out. The hook calls
# `release_side_groups`, looked up in modular.exit when it runs, so a stand-in there shows whether
# it ran (called by hand first, to show that it does); a callback of the probe's own, registered
# last so run first, shows that the callbacks ran.
ran = []
modular.exit.release_side_groups = lambda: ran.append("modular.exit.release_process_groups")
modular.exit.release_process_groups()
opt_outs["the exit hook, called by hand"] = ran[:]
ran.clear()
atexit.unregister(modular.exit.release_process_groups)
atexit.register(lambda: ran.append("the probe's own callback"))
atexit._run_exitfuncs()
opt_outs["atexit callbacks run after the opt-out"] = ran

print("RESULT " + json.dumps({"changes": changes, "opt_outs": opt_outs}))
'''

# What README.md's section lists, as the probe reports it.
EXPECTED_CHANGES = {
    "optimizer step pre-hooks": ["modular.compose.params._reject_sharded_tensors"],
    "atexit callbacks": ["modular.exit.release_process_groups"],
    "warnings filters": [
        [
            "ignore",
            "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
            "Warning",
            None,
            0,
        ]
    ],
    "foreach types": {
        "torch.optim.optimizer": ["modular.kernels.views.ShardView"],
        "torch.utils._foreach_utils": ["modular.kernels.views.ShardView"],
    },
}


@pytest.fixture(scope="module")
def probe() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, f"the import probe failed:\n{out.stderr[-4000:]}"
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## What `import modular` changes\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "README.md has no section '## What `import modular` changes'"
    return match.group(1)


def test_import_changes_exactly_what_the_readme_lists(probe: dict) -> None:
    assert probe["changes"] == EXPECTED_CHANGES, (
        "`import modular` changed global state other than README.md's list ('What `import modular` "
        "changes'): name the new change there and in EXPECTED_CHANGES, or remove it. Got "
        f"{json.dumps(probe['changes'], indent=1)}"
    )


def test_the_readme_names_every_change_and_its_opt_out() -> None:
    section = _readme_section()
    for token in (
        "register_optimizer_step_pre_hook",
        "modular/compose/params.py",
        "modular.compose.params.remove_optimizer_check()",
        "modular.exit.release_process_groups",
        "atexit.unregister(modular.exit.release_process_groups)",
        "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        'warnings.filterwarnings("default", message="fbgemm::dense_embedding_codegen_lookup_function")',
        "_foreach_supported_types",
        "ShardView",
    ):
        assert token in section, f"README.md's 'What `import modular` changes' lacks {token!r}"
    rows = [row for row in section.splitlines() if row.startswith("| ") and not row.startswith("| what")]
    assert len(rows) == 4, f"the README's table has {len(rows)} rows, the probe expects 4 changes"


def test_remove_optimizer_check_takes_the_hook_out(probe: dict) -> None:
    opt_outs = probe["opt_outs"]
    raised = opt_outs["optimizer check raised"]
    assert raised is not None and "modular.shard has since replaced" in raised, raised
    assert opt_outs["stepped after remove_optimizer_check"] == [0.0, 0.0, 0.0]
    assert opt_outs["optimizer step pre-hooks after remove_optimizer_check"] == []


def test_the_readme_opt_outs_of_the_exit_hook_and_the_warning_filter_work(probe: dict) -> None:
    opt_outs = probe["opt_outs"]
    assert opt_outs["the exit hook, called by hand"] == ["modular.exit.release_process_groups"]
    assert opt_outs["atexit callbacks run after the opt-out"] == ["the probe's own callback"]
    assert opt_outs["warnings shown while filtered"] == 0
    assert opt_outs["warnings shown after the opt-out"] == 1
