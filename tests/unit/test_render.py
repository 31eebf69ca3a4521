"""``autostate/render.py``: the repr and the treescope view of models."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import pytest
from export_models import (  # noqa: I001 - tests/ is on sys.path
    XS,
    Counter,
    HostCounter,
    Labelled,
    LabelledChild,
    Net,
    run,
)

import autostate
from autostate.render import model_repr

render_module = sys.modules["autostate.render"]


# --- repr ----------------------------------------------------------------------------------


def test_repr_shows_parameters_and_states_with_their_kind():
    text = repr(Net())
    assert text.startswith("Net(\n")
    for line in [
        "w=f32[3,3]",
        "half=bf16[3]",
        "gain=f32[]",
        "table={'ids': i32[3]}",
        "act='tanh'",
        "mean=<state 'blocks[0].norm.mean' category='state' initial value: f32[3]>",
        "kv=<state 'cache' category='cache' initial value: {'k': f32[3], 't': i32[]}>",
        "first=<Block, same as 'blocks[0]'>",
    ]:
        assert line in text, line
    _, trained = run(Net(), XS[:1])
    assert "ema=<state 'ema' category='state' value: bf16[3]>" in repr(trained)
    f, _ = trained.functionalize()
    assert f"calls=<state 'blocks[1].calls' category='state' handled by {f.handler_id!r}>" in repr(
        f
    )
    assert repr(Counter()) == "Counter(count=<state 'count' category='state' initial value: i32[]>)"
    # Names are relative to the model given.
    assert model_repr(trained.blocks[1].norm) == (
        "Norm(\n"
        "  scale=f32[3],\n"
        "  mean=<state 'mean' category='state' value: f32[3]>,\n"
        "  var=<state 'var' category='state' value: f32[3]>,\n"
        ")"
    )


STACKED = """
import jax.numpy as jnp
import autostate


@autostate.stateful
class Norm:
    def __init__(self):
        self.scale = jnp.ones(3)
        self.mean = jnp.zeros(3)

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        return x * self.scale


@autostate.stateful
class Net:
    def __init__(self):
        self.blocks = autostate.stack([Norm() for _ in range(4)])
"""


def test_repr_shows_a_stack_its_depth_and_a_layer_its_slice(write_module):
    mod = write_module(STACKED)
    model = mod.Net()
    assert repr(model) == (
        "Net(\n"
        "  blocks=Stack(\n"
        "    depth=4,\n"
        "    stacked=Norm(\n"
        "      scale=f32[4,3],\n"
        "      mean=<state 'blocks.mean' category='state' value: f32[4,3]>,\n"
        "    ),\n"
        "  ),\n"
        ")"
    )
    assert repr(model.blocks) == (
        "Stack(\n"
        "  depth=4,\n"
        "  stacked=Norm(scale=f32[4,3], mean=<state 'mean' category='state' value: f32[4,3]>),\n"
        ")"
    )
    assert repr(model.blocks[2]) == (
        "Norm(\n"
        "  scale=f32[3],\n"
        "  mean=<state 'mean' category='state' of layer 2 of a stack: f32[3]>,\n"
        ")"
    )


@autostate.stateful
class _Switching:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fn = self._a

    def _a(self, x):
        self.n = self.n + 1
        return x


def test_repr_shows_a_method_of_the_model_it_holds_by_reference():
    # (its own repr is the model's: repr recursed until RecursionError)
    text = repr(_Switching())
    assert "fn=<bound method _Switching._a of <_Switching, same as 'self'>>" in text


def test_repr_keeps_a_repr_the_class_or_a_base_defines():
    assert repr(Labelled()) == "Labelled!"
    assert repr(LabelledChild()) == "Labelled!"
    assert (
        model_repr(Labelled()) == "Labelled(count=<state 'count' category='state' initial value: f32[]>)"
    )


def test_host_fallback_states_are_read_from_their_store(tmp_path):
    model = HostCounter()
    model(jnp.ones(2))
    assert {k: int(v) for k, v in autostate.state_dict(model).items()} == {"count": 3}
    assert list(autostate.param_dict(model)) == ["w"]
    autostate.save(tmp_path / "host.npz", model)
    params, states = autostate.load_arrays(tmp_path / "host.npz")
    assert int(states["count"]) == 3 and list(params) == ["w"]
    assert repr(model) == "HostCounter(w=f32[2], count=<state 'count' category='state' in a host store>)"



# --- treescope -----------------------------------------------------------------------------


def test_treescope_shows_parameters_submodels_and_highlighted_states():
    treescope = pytest.importorskip("treescope")
    text = treescope.render_to_text(Net())
    assert text.startswith("Net(\n")
    for part in [
        "blocks=[",
        "Block(w=",
        "Norm(scale=",
        "half=",
        "table={'ids': ",
        "act='tanh'",
        "mean=<state 'blocks[0].norm.mean' category='state' initial value: ",
        "calls=<state 'blocks[1].calls' category='state' initial value: ",
        "kv=<state 'cache' category='cache' initial value:",
        "ema=<state 'ema' category='state' initial value: ",
    ]:
        assert part in text, part
    _, trained = run(Net(), XS[:1])
    assert "ema=<state 'ema' category='state' value: " in treescope.render_to_text(trained)
    f, _ = trained.functionalize()
    handled = treescope.render_to_text(f.model)
    assert f"calls=<state 'blocks[1].calls' category='state' handled by {f.handler_id!r}>" in handled
    # Names are relative to the outermost model rendered, as in the plain repr.
    norm = treescope.render_to_text({"m": trained.blocks[1].norm})
    assert "mean=<state 'mean' category='state' value:" in norm
    assert "scale=" in norm
    host = HostCounter()
    host(jnp.ones(2))
    assert "count=<state 'count' category='state' in a host store>" in treescope.render_to_text([host])
    # The HTML view puts each state in a box of the highlight color: the 8 states, and
    # the 3 of blocks[0] again under `first` (treescope marks it a repeated object).
    html = treescope.render_to_html(Net(), compressed=False)
    assert html.count(f"--block-color: {render_module.TREESCOPE_STATE_COLOR};") == 8 + 3
    assert "state &#x27;blocks[0].norm.mean&#x27; category=&#x27;state&#x27; initial value" in html


def test_treescope_keeps_a_treescope_repr_the_class_defines():
    treescope = pytest.importorskip("treescope")

    @autostate.stateful
    class Own:
        def __init__(self):
            self.count = jnp.zeros(())

        def __call__(self):
            self.count += 1

        def __treescope_repr__(self, path, subtree_renderer):
            return treescope.rendering_parts.text("Own!")

    assert treescope.render_to_text(Own()) == "Own!"
    assert "Counter(" in treescope.render_to_text(Counter())


def test_functional_model_renders_its_handled_model_in_treescope():
    import treescope

    f, _ = autostate.stateful(_TreescopeCounter)().functionalize()
    text = treescope.render_to_text(f)
    assert text.startswith("FunctionalModel(")
    assert "handler_id='autostate:*'" in text
    assert "<state 'n' category='state' handled by 'autostate:*'>" in text


class _TreescopeCounter:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return x
