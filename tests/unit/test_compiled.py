"""``autostate/compiled.py``: ``autostate.jit``'s mechanism, one compile per
structure, packed small arrays, donation, what a call keeps for the next one,
and the refusals at the user's line. (That a compiled call means the plain
call is ``tests/semantics/test_transformations.py``'s.)"""

from __future__ import annotations

import copy
import gc

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import compiled, packing
from autostate.errors import InvalidArgumentError, InvalidTypeError


@autostate.stateful
class Net:
    def __init__(self, big: bool = False):
        self.w = jnp.ones((64, 128) if big else (2,))  # 32 KiB: above the packing size
        self.b = jnp.zeros(2)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return (self.w.sum() + self.b) * x


@autostate.stateful
class Moded(Net):
    def __init__(self):
        super().__init__()
        self.training = True

    def eval(self):
        self.training = False
        return self


def step(model, x):
    y = model(x)
    model.b = model.b + 1.0
    return y.sum()


def counting(fn):
    """``fn`` and a list that grows by one per trace."""
    traces: list[int] = []

    def traced(*args, **kwargs):
        traces.append(1)
        return fn(*args, **kwargs)

    return traced, traces


def test_a_call_updates_the_model_in_place_and_traces_once_per_structure():
    fn, traces = counting(step)
    compiled_step = autostate.jit(fn)
    model = Moded()
    for expected in (4.0, 6.0):
        assert float(compiled_step(model, jnp.ones(2))) == expected
    assert int(model.calls) == 2 and model.b.tolist() == [2.0, 2.0]
    assert len(traces) == 1
    model.eval()  # another mode: another structure, another trace
    compiled_step(model, jnp.ones(2))
    assert len(traces) == 2 and model.training is False
    compiled_step(Moded().eval(), jnp.ones(()))  # another shape of the other arguments
    assert len(traces) == 3


def test_small_arrays_travel_packed_and_a_big_one_alone():
    compiled_step = autostate.jit(step)
    for big, loose in ((False, 0), (True, 1)):
        model = Net(big)
        compiled_step(model, jnp.ones(2))
        # (a call's cache id ends with its models' ids)
        (entry,) = [e for k, e in compiled_step._entries.items() if k[-1] == id(model)]
        assert len(entry.key.loose) == loose
        assert len(entry.buffers) == len(entry.key.layout.dtypes) >= 1
    assert compiled._small(jax.ShapeDtypeStruct((4096,), jnp.float32))
    assert not compiled._small(jax.ShapeDtypeStruct((4097,), jnp.float32))


def test_the_models_old_arrays_are_donated_unless_kept():
    model = Net(big=True)
    old = model.w
    autostate.jit(step)(model, jnp.ones(2))
    assert old.is_deleted() and not model.w.is_deleted()
    kept = Net(big=True)
    old = kept.w
    autostate.jit(step, donate_models=False)(kept, jnp.ones(2))
    assert not old.is_deleted()
    with pytest.raises(InvalidArgumentError, match="does not take donate_argnums"):
        autostate.jit(step, donate_argnums=0)


def test_the_arrays_a_call_changed_stay_packed_until_an_eager_read(monkeypatch):
    unpacks: list[int] = []
    materialize = packing.PackedValues.materialize

    def counted(self):
        if self.values is None:
            unpacks.append(1)
        return materialize(self)

    monkeypatch.setattr(packing.PackedValues, "materialize", counted)
    model, compiled_step = Net(), autostate.jit(step)
    for _ in range(3):
        compiled_step(model, jnp.ones(2))
    d = vars(model)  # b and calls changed: lazy values of the buffers; w is the array
    assert type(d["b"]) is packing.LazyValue and type(d["calls"]) is packing.LazyState
    assert d["w"] is model.w and unpacks == []  # (the calls passed the buffers on)
    b, calls = model.b, model.calls
    assert unpacks == [1]  # one unpack for every value of the call
    assert model.b is b and unpacks == [1]
    compiled_step(model, jnp.ones(2))  # donates the buffers: what was read stays
    assert b.tolist() == [3.0, 3.0] and int(calls) == 3 and not b.is_deleted()
    assert model.b.tolist() == [4.0, 4.0] and int(model.calls) == 4
    assert vars(copy.copy(model))["b"] is model.b  # a copy holds the arrays
    model.calls = jnp.zeros((), jnp.int32)  # an eager write replaces the lazy state
    assert type(vars(model)["calls"]) is not packing.LazyState and int(model.calls) == 0


def test_a_weakly_typed_buffer_some_of_whose_arrays_changed_stays_weak():
    @autostate.stateful
    class Weak:
        def __init__(self):
            self.x = jnp.ones(3)
            self.a = jnp.full(2, 1.0)  # weakly typed, as the plain call keeps them
            self.b = jnp.full(2, 1.0)

    def scale(model):
        model.a = model.a * 3

    compiled_scale, model = autostate.jit(scale), Weak()
    for expected in (3.0, 9.0, 27.0):  # (the next call's buffers: the layout it was traced for)
        compiled_scale(model)
        assert model.a.tolist() == [expected] * 2 and model.a.weak_type and model.b.weak_type
    assert len(compiled_scale._after) == 1


def test_two_compiled_functions_take_turns_on_one_model():
    def bump(model):
        model.b = model.b * 2.0
        return model.calls

    first, second = autostate.jit(step), autostate.jit(bump)
    model, plain = Net(), Net()  # (``plain``: the same calls, eagerly)
    for i in range(4):
        for compiled_fn, fn in ((first, step), (second, bump), (second, bump)):
            args = (jnp.ones(2),) if fn is step else ()
            assert compiled_fn(model, *args).tolist() == fn(plain, *args).tolist()
        if i % 2:
            assert model.b.tolist() == plain.b.tolist()  # (read between the turns)
    assert model.b.tolist() == plain.b.tolist() and int(model.calls) == int(plain.calls) == 4


def test_a_model_sharing_a_donated_array_is_refused_by_name():
    model = Net(big=True)
    twin = copy.copy(model)  # (holds the same arrays)
    compiled_step = autostate.jit(step)
    compiled_step(model, jnp.ones(2))
    with pytest.raises(InvalidArgumentError, match=r"`w` \(of model argument 1\) .* deleted"):
        compiled_step(twin, jnp.ones(2))


@autostate.stateful
class Declared:
    def __init__(self):
        self.cache = autostate.state(jax.ShapeDtypeStruct((2,), jnp.bfloat16))  # no value yet
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.cache = x * 2
        return self.cache * self.w


@pytest.mark.parametrize("make", [Declared, lambda: jax.eval_shape(Net)],
                         ids=["declared_state", "eval_shape_model"])
def test_a_model_holding_an_abstract_array_is_refused_by_name(make):
    # (JAX's bare "Argument 'leaves[0]' ... of type ShapeDtypeStruct is not a valid JAX type")
    model = make()
    with pytest.raises(InvalidArgumentError, match=r"`(cache|w)` \(of model argument 1\) .* abstract"):
        autostate.jit(lambda m, x: m(x))(model, jnp.ones(2, jnp.bfloat16))
    if isinstance(model, Declared):  # assigned eagerly first, it compiles
        model(jnp.ones(2, jnp.bfloat16))
        out = autostate.jit(lambda m, x: m(x))(model, jnp.ones(2, jnp.bfloat16))
        assert out.tolist() == [2.0, 2.0] and model.cache.dtype == jnp.bfloat16


@pytest.mark.parametrize("make", [Net, Moded], ids=["arrays", "with_a_static_state"])
def test_the_next_call_on_the_same_models_reuses_the_flatten_until_they_change(make):
    compiled_step = autostate.jit(step)
    model = make()
    compiled_step(model, jnp.ones(2))
    (cache_id,) = compiled_step._entries
    first = compiled_step._entries[cache_id]
    compiled_step(model, jnp.ones(2))
    assert compiled_step._entries[cache_id].key is first.key  # (kept: nothing changed)
    model.b = jnp.full(2, 5.0)  # an eager change: the kept flatten is stale
    assert compiled_step._kept_entry(cache_id) is None
    compiled_step(model, jnp.ones(2))
    assert model.b.tolist() == [6.0, 6.0]


def test_what_a_call_keeps_goes_with_its_model():
    compiled_step = autostate.jit(step)
    model = Net()
    compiled_step(model, jnp.ones(2))
    assert len(compiled_step._entries) == 1
    del model
    gc.collect()
    assert compiled_step._entries == {} and compiled_step._watched == set()
    models = [Net() for _ in range(compiled._ENTRIES + 2)]
    for m in models:
        compiled_step(m, jnp.ones(2))
    assert len(compiled_step._entries) == compiled._ENTRIES


def test_static_arguments_of_a_bound_method_are_numbered_as_the_methods():
    @autostate.stateful
    class Scaler:
        def __init__(self):
            self.s = jnp.ones(())

        def scale(self, x, power):
            self.s = self.s * 2
            return x**power

    scaler = Scaler()
    scale = autostate.jit(scaler.scale, static_argnums=1)
    assert scale._static == (2,) and "power" in scale._static_names
    assert float(scale(jnp.float32(3.0), 2)) == 9.0
    assert float(scale(jnp.float32(3.0), power=3)) == 27.0
    assert float(scaler.s) == 4.0


def test_a_model_itself_compiles_its_call():
    model = Net()
    forward = autostate.jit(model)  # as autostate.jit(model.__call__)
    assert forward(jnp.ones(2)).tolist() == [2.0, 2.0] and int(model.calls) == 1
    forward(jnp.ones(2))
    assert int(model.calls) == 2


def test_inside_a_staging_trace_the_function_runs_as_it_is():
    compiled_step = autostate.jit(step)

    @autostate.jit
    def outer(model, x):
        return compiled_step(model, x) * 2

    model = Net()
    assert float(outer(model, jnp.ones(2))) == 8.0
    assert compiled_step._entries == {} and compiled_step._after == {}
    assert model.b.tolist() == [1.0, 1.0]


def test_called_while_f_runs_its_writes_meet_f_s_rules():
    # A jax.jit inside a method, given the sub-model itself: its state lands in f's
    # states, and a parameter it assigns is refused as f refuses it (never lost).
    def rescale(model, x):
        y = model(x)
        model.w = model.w * 2
        return y.sum()

    compiled_rescale = autostate.jit(rescale)
    compiled_forward = autostate.jit(lambda model, x: model(x).sum())

    @autostate.stateful
    class Outer:
        def __init__(self, fn):
            self.net = Net()
            self.fn = fn

        def __call__(self, x):
            return self.fn(self.net, x)

    f, states = Outer(compiled_forward).functionalize()
    out, states = f(states, jnp.ones(2))
    assert float(out) == 4.0 and int(states["net.calls"]) == 1
    f, states = Outer(compiled_rescale).functionalize()
    with pytest.raises(autostate.AutostateError, match="Net.w is not state"):
        f(states, jnp.ones(2))


def test_lower_gives_the_program_and_refuses_traced_arguments():
    compiled_step = autostate.jit(step)
    model = Net()
    lowered = compiled_step.lower(model, jnp.ones(2))
    assert "func" in lowered.as_text()
    assert model.b.tolist() == [0.0, 0.0]  # (lowered, not run)
    with pytest.raises(InvalidArgumentError, match="traced arguments"):
        jax.jit(lambda x: compiled_step.lower(model, x))(jnp.ones(2))


def test_the_program_names_the_model_arrays_by_their_paths():
    names = []

    def probe(model, x):
        names.append(compiled._argument_names(
            step, (model, x), {}, compiled_step._tracing[2], (), set()
        ))
        return step(model, x)

    compiled_step = autostate.jit(probe)
    compiled_step(Net(), jnp.ones(2))
    compiled_step(Net(big=True), jnp.ones(2))
    small, big = names
    assert small == ("model.w (packed with 1 more small array)", "model.calls.state", "x")
    assert big == ("model.b", "model.calls.state", "model.w", "x")


def test_jax_s_errors_name_the_user_s_function():
    def forward(model, tag):
        return model(jnp.ones(2)).sum()

    with pytest.raises(TypeError, match="argument to <function .*forward at .* path tag"):
        autostate.jit(forward)(Net(), "a string")


def test_a_model_reached_other_than_through_an_argument_is_refused():
    held = Net()

    def closes_over(x):
        return held(x)

    with pytest.raises(InvalidArgumentError, match="through its closure instead of an argument"):
        autostate.jit(closes_over)(jnp.ones(2))

    class Holder:
        def __init__(self):
            self.model = Net()

        def run(self, x):
            return self.model(x)

    with pytest.raises(InvalidArgumentError, match="the object its method is bound to"):
        autostate.jit(Holder().run)(jnp.ones(2))


class _PlainHolder:
    def __init__(self):
        self.net = Net()


@autostate.stateful
class _Holder:
    def __init__(self):
        self.net = Net()


@autostate.stateful
class HoldsPlain:
    def __init__(self):
        self.holder = _PlainHolder()

    def __call__(self, x):
        return self.holder.net(x)


def test_a_model_inside_a_plain_object_of_an_argument_names_the_holder():
    # (the refusal of the tracer it was given advised autostate.jit, the call running)
    model = HoldsPlain()
    with pytest.raises(InvalidTypeError, match="HoldsPlain.holder holds a @stateful model "
                       "inside a plain _PlainHolder .*autostate.jit copies the model") as err:
        autostate.jit(lambda m, x: m(x))(model, jnp.ones(2))
    assert "decorate _PlainHolder with @autostate.stateful" in str(err.value)
    assert int(model.holder.net.calls) == 0
    # Decorated as the fix says, the holder is followed and the write lands.
    model.holder = _Holder()
    autostate.jit(lambda m, x: m(x))(model, jnp.ones(2))
    assert int(model.holder.net.calls) == 1


def test_what_is_not_callable_is_refused_when_compiled():
    # (it was taken, and its first call raised "the first argument must be callable")
    with pytest.raises(InvalidTypeError, match="autostate.jit compiles a function, got int 3"):
        autostate.jit(3)  # type: ignore[call-overload]


def test_a_static_argument_is_hashable_and_holds_no_model():
    model = Net()
    with pytest.raises(InvalidArgumentError, match=r"static argument \[2\] .* cannot be hashed"):
        autostate.jit(lambda m, x, p: m(x) ** p[0], static_argnums=2)(model, jnp.ones(2), [2])
    # A model given as static is read as constants: stale after an eager change.
    forward = autostate.jit(lambda m, x: m(x).sum(), static_argnums=0)
    by_name = autostate.jit(lambda x, m: m(x).sum(), static_argnames="m")
    for call in (lambda: forward(model, jnp.ones(2)), lambda: by_name(jnp.ones(2), m=model)):
        with pytest.raises(InvalidArgumentError, match="static argument .* holds a Net model"):
            call()
    assert int(model.calls) == 0


def test_returning_a_model_or_changing_an_argument_container_is_refused():
    with pytest.raises(InvalidArgumentError, match="returns a model"):
        autostate.jit(lambda model: model)(Net())

    def appends(model, history):
        history.append(model(jnp.ones(2)))
        return 0

    model = Net()
    with pytest.raises(InvalidArgumentError, match="changed a list, dict or other container"):
        autostate.jit(appends)(model, [])
    assert int(model.calls) == 0  # (nothing written back)


def test_a_function_that_raises_leaves_the_models_as_they_were():
    def fails(model, x):
        model(x)
        raise ValueError("stop")

    model = Net()
    with pytest.raises(ValueError, match="stop"):
        autostate.jit(fails)(model, jnp.ones(2))
    assert int(model.calls) == 0 and not model.w.is_deleted()


def test_kept_restores_a_mutable_container_in_place():
    old, new = [1, 2], [3]
    assert compiled._kept(old, new) is old and old == [3]
    assert compiled._kept((1,), (2,)) == (2,)
    assert compiled._kept([1], (2,)) == (2,)


def test_user_path_names_a_leaf_as_the_user_would():
    assert compiled._user_path("models[0].norm.mean.state") == "`norm.mean` (of model argument 1)"
    assert compiled._user_path("models[2].w") == "`w` (of model argument 3)"


def test_shape_of_tells_dtypes_and_weak_types_apart():
    assert compiled._shape_of(jnp.ones(2)) == ((2,), jnp.float32, False)
    assert compiled._shape_of(jnp.asarray(1.0)) != compiled._shape_of(jnp.float32(1.0))
    assert compiled._shape_of("text") is str


def test_one_device_packs_only_single_device_arrays():
    assert compiled._one_device([jnp.ones(2), 1.0, jnp.zeros(3)])
    assert compiled._one_device([])


