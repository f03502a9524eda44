"""Mailboxes on meshes with more axes than TP, on host devices (no GPU): the groups a
MeshMailbox makes, its per-device peer tables, and a ("dp", "tp") decode step lowered for
CUDA with one peer table block per device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kimik3 as k3
from jax_kimik3 import decode, handles
from jax_kimik3.layout import peer_table
from jax_kimik3.mesh_mailbox import groups, table_array

H, NB = k3.KIMI_K3.hidden_size, k3.KIMI_K3.num_attn_res_blocks


def _mesh(shape, axes):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), axes)


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp")])
def test_groups_run_along_the_tp_axis(axes):
    """Group g: the devices along "tp" at the g-th index of the other axes, in axis order."""
    mesh = _mesh((2, 4) if axes[0] == "dp" else (4, 2), axes)
    got = groups(mesh, "tp")
    assert got.shape == (2, 4)
    for g in range(2):
        want = mesh.devices[g] if axes[0] == "dp" else mesh.devices[:, g]
        assert [d.id for d in got[g]] == [d.id for d in want]
    assert sorted(d.id for d in got.flat) == sorted(d.id for d in mesh.devices.flat)


def test_groups_of_three_axes():
    mesh = _mesh((2, 2, 2), ("pp", "tp", "dp"))
    got = groups(mesh, "tp")
    assert got.shape == (4, 2)
    # Row-major over (pp, dp): group 1 is pp = 0, dp = 1.
    assert [d.id for d in got[1]] == [d.id for d in mesh.devices[0, :, 1]]


def test_each_device_holds_its_own_groups_table():
    """table_array: the block on device (g, r) is group g's table, whatever its rank."""
    mesh = _mesh((2, 4), ("dp", "tp"))
    tables = {g: peer_table([0x1000_0000 * (8 * g + r + 1) for r in range(4)]) for g in (0, 1)}
    table = table_array(mesh, "tp", tables)
    assert table.shape == (2, 4, 5, 2) and table.dtype == jnp.uint32
    assert table.sharding.spec == P("dp", "tp")
    where = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    for shard in table.addressable_shards:
        g, _ = where[shard.device.id]
        np.testing.assert_array_equal(np.asarray(shard.data)[0, 0], tables[g])
    # Inside shard_map each device sees only its block: the group's first address.
    first = jax.jit(jax.shard_map(lambda t: t[:, :, 0, :1], mesh=mesh, in_specs=P("dp", "tp"),
                                  out_specs=P("dp", "tp")))(table)
    np.testing.assert_array_equal(np.asarray(first)[:, :, 0],
                                  [[tables[g][0, 0]] * 4 for g in (0, 1)])


def test_mesh_mailbox_needs_gpus():
    with pytest.raises(ValueError, match=r"MeshMailbox needs CUDA GPU devices; got devices "
                                         r"of platform \['cpu'\]"):
        k3.MeshMailbox(_mesh((2, 4), ("dp", "tp")), "tp")
    with pytest.raises(ValueError, match=r"axis_name='model' is not an axis of the mesh"):
        k3.MeshMailbox(_mesh((2, 4), ("dp", "tp")), "model")


def test_spec_groups_are_checked():
    with pytest.raises(ValueError, match=r"groups=0 must be >= 1"):
        k3.MailboxSpec(k3.MailboxLayout(2), groups=0)
    with pytest.raises(ValueError, match=r"groups=2: a virtual mailbox"):
        k3.MailboxSpec(k3.MailboxLayout(2), virtual=True, groups=2)


pytest.importorskip("cutlass")


def test_dp_tp_decode_step_lowers_with_a_table_per_device():
    """The canonical step on a ("dp", "tp") = (2, 4) mesh of host devices, lowered for CUDA:
    the peer table is an operand split over both axes (a [5, 2] block per device, so each of
    the two groups reads its own), the rows are split over dp, and the tails are kernels
    with no XLA collective."""
    mesh = _mesh((2, 4), ("dp", "tp"))
    layers, b = 2, 4
    params = jax.eval_shape(lambda: decode.init_params(jax.random.key(0), mesh, layers))
    spec = k3.MailboxSpec(k3.MailboxLayout(4), groups=2)
    step = decode.make_step(mesh, params, layers, "kernel", spec)
    rows = NamedSharding(mesh, P("dp"))
    table = decode.table_shape(mesh, 4)
    args = (params, jax.ShapeDtypeStruct((2 * b, H), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((2 * b, NB, H), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct(table.shape, table.dtype,
                                 sharding=NamedSharding(mesh, P("dp", "tp"))))
    assert table.shape == (2, 4, 5, 2)
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    main = re.search(r"func.func public @main\((.*?)\) ->", text, re.S).group(1)
    table_arg = [a for a in re.split(r", %", main) if "tensor<2x4x5x2xui32>" in a]
    # Split over dp and tp (Shardy's or GSPMD's notation, whichever this JAX lowers with).
    assert len(table_arg) == 1 and re.search(r'\[\{"dp"\}, \{"tp"\}, \{\}, \{\}\]|'
                                             r"devices=\[2,4,1,1\]", table_arg[0]), table_arg
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") >= layers
    assert "all-reduce" not in text and "all_reduce" not in text
    # The same step with a one-group spec is refused: both groups would share its buffers.
    one = decode.make_step(mesh, params, layers, "kernel", k3.MailboxSpec(k3.MailboxLayout(4)))
    with pytest.raises(ValueError, match=r"use MeshMailbox\(mesh, 'tp'\), one mailbox per group"):
        one.trace(*args)


def test_dp_tp_all_reduce_lowers_with_a_table_per_device():
    mesh = _mesh((2, 4), ("dp", "tp"))
    spec = k3.MailboxSpec(k3.MailboxLayout(4), groups=2)
    f = jax.shard_map(lambda rows, t: k3.all_reduce(rows, spec, axis_name="tp", peer_table=t),
                      mesh=mesh, in_specs=(P("dp"), P("dp", "tp")), out_specs=P("dp"))
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((16, H), jnp.bfloat16),
                            jax.ShapeDtypeStruct((2, 4, 5, 2), jnp.uint32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") == 1
    assert "all-reduce" not in text


def _stand_in(mesh, axis_name):
    """A MeshMailbox's fields without its memory (CPU: nothing to allocate), for the checks."""
    box = object.__new__(k3.MeshMailbox)
    box.mesh, box.axis_name = mesh, axis_name
    box.spec = k3.MailboxSpec(k3.MailboxLayout(mesh.shape[axis_name]),
                              groups=mesh.size // mesh.shape[axis_name])
    box._groups = {0: None}
    return box


def _reduce_on(mesh, mailbox, axis_name="tp", table_shape=None):
    ndim = mesh.devices.ndim
    table_shape = table_shape or (1,) * ndim + (mailbox.spec.tp + 1, 2)
    f = jax.shard_map(lambda rows, t: k3.all_reduce(rows, mailbox, axis_name=axis_name,
                                                    peer_table=t.reshape(table_shape)),
                      mesh=mesh, in_specs=(P(mesh.axis_names), P(*mesh.axis_names)),
                      out_specs=P(mesh.axis_names))
    return jax.jit(f).trace(jax.ShapeDtypeStruct((mesh.size * 4, H), jnp.bfloat16),
                            jax.ShapeDtypeStruct((*mesh.devices.shape, mailbox.spec.tp + 1, 2),
                                                 jnp.uint32))


def test_mesh_mailbox_serves_its_own_mesh_and_axis():
    """A MeshMailbox used on another axis, another mesh, or with a table that is not one
    device's block is refused at trace time (each would send rows to another group)."""
    mesh = _mesh((2, 4), ("dp", "tp"))
    box = _stand_in(mesh, "tp")
    _reduce_on(mesh, box)  # its own mesh and axis: traces
    square = _mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"axis_name='dp', but the mailbox's groups run along "
                                         r"axis 'tp'"):
        _reduce_on(square, _stand_in(square, "tp"), axis_name="dp")
    with pytest.raises(ValueError, match=r"the mesh here has axes \{'x': 2, 'tp': 4\}; the "
                                         r"mailbox was made for the mesh \{'dp': 2, 'tp': 4\}"):
        _reduce_on(_mesh((2, 4), ("x", "tp")), box)
    with pytest.raises(ValueError, match=r"peer_table has shape=\(5, 2\) dtype=uint32; "
                                         r"expected shape=\(1, 1, 5, 2\)"):
        _reduce_on(mesh, box, table_shape=(5, 2))


class _Device:
    """A GPU device of another process, as far as MeshMailbox reads one (CPU: none exist)."""

    platform = "gpu"

    def __init__(self, id, process_index):
        self.id, self.process_index, self.local_hardware_id = id, process_index, id // 2

    def __repr__(self):
        return f"gpu:{self.id} of process {self.process_index}"


def test_a_failed_mesh_mailbox_gives_up_on_every_group(monkeypatch):
    """A process that cannot make its MeshMailbox gives up on every group it shares with
    other processes, made or not: a peer already waiting in a later group's exchange stops at
    once with the reason instead of running out the exchange's timeout."""
    from tests.test_handles import MemoryClient

    from jax_kimik3 import handles, mesh_mailbox
    from jax_kimik3.store import Abandoned, Store

    client = MemoryClient()
    monkeypatch.setattr(handles, "Store", lambda: Store(client, process_id=0))

    def fails(devices, **kwargs):
        raise RuntimeError("cuMemCreate: out of memory")

    monkeypatch.setattr(mesh_mailbox.Mailbox, "for_processes", fails)
    # ("dp", "tp") = (2, 2): group 0 is devices 0, 1 and group 1 devices 2, 3, each group's
    # ranks in processes 0 and 1.
    mesh = Mesh(np.array([_Device(i, i % 2) for i in range(4)]).reshape(2, 2), ("dp", "tp"))
    with pytest.raises(RuntimeError, match="cuMemCreate: out of memory"):
        k3.MeshMailbox(mesh, "tp")
    said = [k for k in client.values if re.search(r"/group1/abandoned/0$", k)]
    assert len(said) == 1 and any(k.endswith("/group0/abandoned/0") for k in client.values)
    name = said[0].split("/", 1)[1].rsplit("/", 2)[0]  # the group's name, below the namespace
    peer = handles.ProcessGroup(name, 1, (0, 1), store=Store(client, process_id=1),
                                timeout_ms=60_000)
    with pytest.raises(Abandoned, match=r"process 0: MeshMailbox: RuntimeError: cuMemCreate: "
                                        r"out of memory"):
        handles.barrier(peer, "agree")  # returns at once: no 60 s wait


def test_the_exchange_timeout_reaches_every_group(monkeypatch):
    """MeshMailbox(exchange_timeout_ms=...) bounds the handle exchange of each group that
    spans processes: the ProcessGroup of Mailbox.for_processes waits that long, no longer."""
    from tests.test_handles import MemoryClient

    from jax_kimik3 import mailbox
    from jax_kimik3.store import Store

    monkeypatch.setattr(handles, "Store", lambda: Store(MemoryClient(), process_id=0))
    groups = []

    def made(self, local, layout, *, group=None, **kwargs):
        groups.append(group)
        raise RuntimeError("stop here: no GPU memory on CPU")

    monkeypatch.setattr(mailbox.Mailbox, "__init__", made)
    monkeypatch.setattr(handles, "abandon", lambda group, reason: None)
    mesh = Mesh(np.array([_Device(i, i % 2) for i in range(2)]).reshape(1, 2), ("dp", "tp"))
    with pytest.raises(RuntimeError, match="stop here"):
        k3.MeshMailbox(mesh, "tp", exchange_timeout_ms=1_500)
    assert [g.timeout_ms for g in groups] == [1_500.0]
    with pytest.raises(RuntimeError, match="stop here"):
        k3.Mailbox.for_processes(mesh.devices.flat, name="box")
    assert groups[-1].timeout_ms == handles.EXCHANGE_TIMEOUT_MS


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_a_bad_exchange_timeout_is_refused(bad):
    mesh = Mesh(np.array([_Device(i, i % 2) for i in range(2)]).reshape(1, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=rf"exchange_timeout_ms={re.escape(repr(bad))} must "
                                         r"be a number in \[0.001, "):
        k3.MeshMailbox(mesh, "tp", exchange_timeout_ms=bad)
    with pytest.raises(ValueError, match=r"exchange_timeout_ms=.* must be a number"):
        k3.Mailbox.for_processes(mesh.devices.flat, name="box", exchange_timeout_ms=bad)
