"""The model contracts of models/base.py: both families satisfy them structurally, and nothing outside a family's own
files dispatches on its classes (the engines and sharding/ use only the protocols)."""
import ast
import pathlib

import jax
import pytest

from longstraw_jax import models
from longstraw_jax.engine.layerwise import Stage
from longstraw_jax.models.base import BlockModel, CausalLM, MeshAdapter, Model, PromptState
from tests.helpers import ROOT

PACKAGE = pathlib.Path(ROOT) / "longstraw_jax"
FAMILY_CLASSES = {"Qwen36", "Qwen36Config", "Qwen36State", "Glm52", "Glm52Config", "Glm52State"}
# a family's own folder (the model and its mesh adapter), and the registry that maps model_type to the classes
FAMILY_FOLDERS = ("models/qwen36/", "models/glm52/")
REGISTRY = "models/registry.py"


@pytest.mark.parametrize("config", [models.Qwen36Config.tiny(), models.Glm52Config.tiny()], ids=["qwen36", "glm52"])
def test_families_satisfy_the_protocols(config):
    model = models.build(config)
    assert isinstance(model, Model)
    assert isinstance(model.mesh_adapter(), MeshAdapter)
    assert isinstance(model.mesh_adapter().min_segment, int)
    state = jax.eval_shape(lambda: model.init_state(4))
    assert isinstance(state, PromptState) and isinstance(state, model.state_type) and state.length == 4


def test_both_families_backpropagate_block_by_block():
    """Qwen3.6 is a `BlockModel` (one kind of block); GLM-5.x gives `layerwise` one `Stage` per segment (its blocks
    carry the IndexShare selection). Neither keeps `CausalLM`'s autodiff hooks; the engines call
    `model.branch_grads` either way."""
    assert isinstance(models.build(models.Qwen36Config.tiny()), BlockModel)
    glm = models.build(models.Glm52Config.tiny())
    assert glm.block_stages() and all(isinstance(stage, Stage) for stage in glm.block_stages())
    for model in (models.build(models.Qwen36Config.tiny()), glm):
        assert type(model).branch_grads is not CausalLM.branch_grads
        assert type(model).chunk_grads is not CausalLM.chunk_grads


def _class_dispatch(tree: ast.AST) -> list[str]:
    """`isinstance(x, C)` / `type(x) is C` / `hasattr(model, ...)` where C names a family class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "isinstance" and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & FAMILY_CLASSES:
                    found.append(f"line {node.lineno}: isinstance on {sorted(names & FAMILY_CLASSES)}")
            if node.func.id == "hasattr" and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id == "model":
                found.append(f"line {node.lineno}: hasattr(model, ...)")
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is) for op in node.ops):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if "type" in names and names & FAMILY_CLASSES:
                found.append(f"line {node.lineno}: type(...) is a family class")
    return found


def test_no_dispatch_on_model_classes_outside_family_files():
    assert all((PACKAGE / folder).is_dir() for folder in FAMILY_FOLDERS) and (PACKAGE / REGISTRY).is_file()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == REGISTRY or rel.startswith(FAMILY_FOLDERS):
            continue
        found = _class_dispatch(ast.parse(path.read_text()))
        if found:
            offenders[rel] = found
    assert not offenders, offenders


def test_dispatch_finder_finds_dispatch():
    src = "def f(model):\n    if isinstance(model, Glm52):\n        pass\n    return hasattr(model, 'block')\n"
    assert len(_class_dispatch(ast.parse(src))) == 2
    assert _class_dispatch(ast.parse("isinstance(x, int)")) == []
