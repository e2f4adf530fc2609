"""What a member with a valid certificate cannot do to the shared store and to a run's
state (issue 44, points 3 and 4): replace another writer's object with a version far
ahead, or have a joiner restore a state it forged. Real daemons on loopback; the
member is a daemon of the cluster whose store is driven by hand (tests/hostile/
harness.py), so it signs with its own key as any member can."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest

from ciuic_p2p.config import Config
from ciuic_p2p.core.store.messages import Manifest, Ref, StoreKind
from ciuic_p2p.core.store.runstate import run_window, state_refusal
from ciuic_p2p.identity import NodeKey
from tests.hostile.harness import HonestMesh, fast_config, until

pytestmark = pytest.mark.network

NAME = "model/weights"


def store_config() -> Config:
    config = fast_config()
    store = dataclasses.replace(config.store, replicas=3, fetch_timeout_s=5.0)
    return dataclasses.replace(config, store=store)


async def test_a_member_cannot_replace_another_writers_object_with_a_far_version(
    tmp_path: Path,
) -> None:
    """Issue 44, point 4: HOLDs of ``model/weights`` at version 10^12 had every node
    return the member's bytes after it left, and an honest ``put --local`` at version 1
    was dropped. Now the member's HOLD of a version that far ahead is refused, its own
    versions never displace the honest writer's, and ``store get`` says whose it is."""
    rng = random.Random(44)
    honest_names = ["writer", "a", "b"]
    mesh = HonestMesh(tmp_path, [*honest_names, "mallory"], store_config())
    async with mesh:
        await mesh.form()
        stores = {n: mesh.nodes[n].store for n in mesh.names}
        honest = rng.randbytes(70_000)
        manifest, held_by = await stores["writer"].put(NAME, honest, version=1)
        assert len(held_by) == 3, held_by

        # The member writes the same name, far ahead, and asks everyone to hold it.
        forged = rng.randbytes(70_000)
        mine = stores["mallory"].put_local(NAME, 10**12, forged)
        for name in honest_names:
            stores["mallory"]._send(mesh.peer(name), Ref(StoreKind.HOLD, NAME, 10**12, mine.root))

        def answered(name: str) -> bool:
            s = stores[name]
            return bool(s.counters["store_holds_refused"]) or any(
                h.manifest.version == 10**12 for h in s.holder.objects.get(NAME, [])
            )

        await until(lambda: all(answered(n) for n in honest_names), 20, "every HOLD answered")
        for name in honest_names:
            assert stores[name].counters["store_holds_refused"] >= 1, name
        # While the member is there with its far version: a plain get on a node that
        # holds the writer's copy (and has none of its own) returns the name's first
        # writer's version, not the newest of any writer (the member's, before).
        writer = stores["writer"].writer
        holding = [n for n in ("a", "b") if stores[n].holder.newest(NAME, writer) is not None]
        assert holding
        for name in holding:
            data, fetch = await stores[name].get_any(NAME)
            assert data == honest and fetch.writer == writer, name
        await mesh.daemons["mallory"].leave()
        gone = mesh.peer("mallory")
        await until(
            lambda: all(gone not in mesh.daemons[n].mesh.view() for n in honest_names),
            20,
            "mallory is gone everywhere",
        )

        for name in honest_names:
            data, fetch = await stores[name].get_any(NAME)
            assert data == honest, name
            assert fetch.writer == writer, name
            assert fetch.version == 1

        # An honest ``put --local`` at version 1 on another node is its own version:
        # not dropped, and what a plain get there returns.
        local = rng.randbytes(5000)
        stores["a"].put_local(NAME, 1, local)
        data, fetch = await stores["a"].get_any(NAME)
        assert data == local and fetch.writer == stores["a"].writer
        # The writer's version is still there, by the writer's peer ID or node name.
        data, fetch = await stores["a"].get_any(NAME, writer="writer")
        assert data == honest and fetch.writer == writer
        assert manifest.verify()


async def test_a_member_cannot_hold_an_object_in_another_writers_name(tmp_path: Path) -> None:
    """A manifest that claims the honest writer's key with the member's signature is
    no donor: a HOLD of it fails, and the honest version stays the only one."""
    mesh = HonestMesh(tmp_path, ["writer", "a", "mallory"], store_config())
    async with mesh:
        await mesh.form()
        stores = {n: mesh.nodes[n].store for n in mesh.names}
        await stores["writer"].put(NAME, b"honest" * 1000, version=1)
        fake = Manifest.build(NAME, 2, b"forged" * 1000, stores["a"].settings.piece_bytes)
        key = mesh.daemons["writer"].key.public_key
        fake = fake.signed(key, mesh.daemons["mallory"].key.sign)
        assert not fake.verify()
        assert stores["mallory"].holder.put_held(fake, b"forged" * 1000)
        stores["mallory"]._send(mesh.peer("a"), Ref(StoreKind.HOLD, NAME, 2, fake.root))
        await until(
            lambda: (
                stores["a"].counters["store_holds_failed"] >= 1
                or stores["a"].holder.find(NAME, 2, fake.root) is not None
            ),
            20,
            "the HOLD answered",
        )
        assert stores["a"].holder.find(NAME, 2, fake.root) is None
        data, fetch = await stores["a"].get_any(NAME)
        assert data == b"honest" * 1000 and fetch.writer == stores["writer"].writer


def test_a_state_far_ahead_or_with_floors_past_the_announced_steps_is_refused() -> None:
    """Issue 44, point 3, the arithmetic a joiner applies (core.store.runstate): the
    run's step is the lower median of the replicas' announced steps, so a member
    that announces 10^6 moves nothing; a state at 10^6, or one at a plausible step
    whose floors are 10^12, does not agree with the run; an honest one does."""
    announced = {"r1": 500, "r2": 505, "mallory": 10**6}
    window = run_window(announced, 100)
    assert window is not None and window.step == 505 and window.high == 605
    assert state_refusal(window, 10**6, {"r1": 400}) is not None
    assert state_refusal(window, 506, {"r1": 10**12}) is not None
    assert state_refusal(window, 506, {"gone": 10**12}) is not None
    assert state_refusal(window, 506, {"r1": "x"}) is not None
    assert state_refusal(window, 503, {"r1": 500, "r2": 503, "old": 300}) is None
    two = run_window({"r1": 500, "mallory": 10**6}, 100)
    assert two is not None and two.step == 500


def test_a_store_manifest_names_its_writer_by_its_key() -> None:
    key = NodeKey.generate()
    m = Manifest.build(NAME, 3, os.urandom(10_000), 4096).signed(key.public_key, key.sign)
    assert m.verify() and m.writer == key.peer_id
    other = NodeKey.generate()
    assert not dataclasses.replace(m, writer_key=other.public_key).verify()
    assert not dataclasses.replace(m, version=4).verify()


@pytest.mark.processes
def test_a_joiner_does_not_restore_a_forged_state_that_every_node_holds(tmp_path: Path) -> None:
    """Issue 44, point 3: a member fetched ``state/<run>``, set its parameters to NaN
    and noise and its floors to 10^12, wrote it at version 10^6 and had every node hold
    it; a joiner restored it (start step 10^6). Now the joiner asks only the run's
    replicas' states within the replicas' window, checks what it gets, and starts
    from an honest replica's state."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from ciuic_p2p.core.store.statefile import pack_state, read_header  # noqa: PLC0415
    from ciuic_p2p.train.attach import attach  # noqa: PLC0415
    from tests.train.test_elastic import Trainer, _config, _daemons, _model  # noqa: PLC0415

    config = _config()
    daemons = _daemons(tmp_path, 4, config)  # two replicas, the member, the joiner
    trainers: list[Trainer] = []
    try:
        models = [_model(0), _model(0)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.02) for m in models]
        attached = {}

        def attach_one(i: int) -> None:
            attached[i] = attach(models[i], opts[i], run="t", daemon=daemons[i], config=config,
                                 min_replicas=2, join_timeout_s=60)  # fmt: skip

        threads = [threading.Thread(target=attach_one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        trainers = [Trainer(attached[i], models[i], opts[i], 10**6, i) for i in range(2)]
        for t in trainers:
            t.start()
        deadline = time.monotonic() + 120
        while min(t.done_steps for t in trainers) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(t.done_steps for t in trainers) >= 30, [t.error for t in trainers]

        # The member takes an honest state, and forges one: NaN and noise, floors
        # at 10^12, version 10^6; every node is asked to hold it.
        mallory = daemons[2]
        store = mallory.node.store
        name = attached[0].state.state_name
        data, _ = mallory._call(store.get(name, 1), 30)
        read_header(data)  # an honest state of the run, as fetched
        buckets = [b.detach().clone() for b in attached[0].buckets]
        for b in buckets:
            b.normal_(0, 1e3)
        buckets[0].view(-1)[0] = float("nan")
        peers = [attached[0].replica.peer, attached[1].replica.peer]
        forged, compat = pack_state(
            attached[0].layout.layout_id, buckets, None, {"applied": dict.fromkeys(peers, 10**12)}
        )
        m = store.put_local(name, 10**6, bytes(forged), compat)
        for d in daemons:
            if d is not mallory:
                store._send(d.daemon.peer_id, Ref(StoreKind.HOLD, name, 10**6, m.root))

        def held_everywhere() -> bool:
            return all(
                d.node.store.holder.find(name, 10**6, m.root) is not None
                or d.node.store.counters["store_holds_refused"]
                for d in daemons
                if d is not mallory
            )

        deadline = time.monotonic() + 30
        while not held_everywhere() and time.monotonic() < deadline:
            time.sleep(0.05)

        late = _late_joiner(daemons[3], config, min_replicas=3)
        info = late.restored
        assert info["source"] == "mesh", info
        assert late.start_step < 10**5, info
        assert info["writer"] in peers, info
        assert all(torch.isfinite(b).all() for b in late.buckets)
        late.close()
    finally:
        for t in trainers:
            t.steps = 0
            t.go_on.set()
        for t in trainers:
            t.join(30)
        for sync in attached.values():
            sync.close()
        for d in daemons:
            d.stop(leave=False)


@pytest.mark.processes
def test_a_joiner_refuses_a_replicas_plausible_forged_state_that_others_do_not_vouch_for(
    tmp_path: Path,
) -> None:
    """Issue 44, point 3: a member that is a replica of the run holds, as its own
    state, noise at a step just ahead of the run with plausible floors: every check
    on the state alone passes, and a joiner that asks the newest state took it. Now
    the joiner compares samples of two other replicas' states with it, refuses it,
    and takes an honest replica's state that they vouch for."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from ciuic_p2p.core.store.statefile import pack_state  # noqa: PLC0415
    from ciuic_p2p.train.attach import attach  # noqa: PLC0415
    from ciuic_p2p.train.hook import MeshSync  # noqa: PLC0415
    from tests.train.test_elastic import _config, _daemons, _model  # noqa: PLC0415

    base = _config()
    bound = 400  # the run's window: the forged state stays the newest while it lasts
    config = dataclasses.replace(
        base,
        train=dataclasses.replace(base.train, staleness_bound_steps=bound),
        # The newest offer only: the joiner asks for the member's, deterministically.
        store=dataclasses.replace(base.store, state_version_slack_steps=0),
    )
    daemons = _daemons(tmp_path, 4, config)  # replicas a, b, the member m; the joiner
    stop = threading.Event()
    attached: dict[int, MeshSync] = {}
    models = [_model(0), _model(0), _model(0)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.02) for m in models]
    loops: list[threading.Thread] = []
    errors: list[BaseException] = []

    def attach_one(i: int) -> None:
        attached[i] = attach(models[i], opts[i], run="t", daemon=daemons[i], config=config,
                             min_replicas=3, join_timeout_s=60)  # fmt: skip

    def train(i: int) -> None:  # slow steps: the forged version stays ahead of the run
        gen = torch.Generator().manual_seed(i)
        target = torch.linspace(-1, 1, 16).unsqueeze(1)
        try:
            while not stop.is_set():
                x = torch.randn(32, 16, generator=gen)
                loss = ((models[i](x) - x @ target) ** 2).mean()
                opts[i].zero_grad()
                loss.backward()
                opts[i].step()
                attached[i].step()
                stop.wait(0.1)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=attach_one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        loops = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(3)]
        for t in loops:
            t.start()
        deadline = time.monotonic() + 60
        while min(s.replica.step for s in attached.values()) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        steps = [s.replica.step for s in attached.values()]
        assert min(steps) >= 20, errors

        # The member writes noise as its own state, at a step a little ahead of the
        # run and with floors at what each origin announced: plausible in every field.
        honest = {attached[0].replica.peer, attached[1].replica.peer}
        mallory = daemons[2]
        name = attached[0].state.state_name
        noise = [torch.randn_like(b).mul_(b.abs().mean() * 3) for b in attached[0].buckets]
        floors = {s.replica.peer: s.replica.step for s in attached.values()}
        forged_step = max(steps) + bound // 2
        forged, compat = pack_state(attached[0].layout.layout_id, noise, None, {"applied": floors})
        store = mallory.node.store

        async def hold_forged() -> None:  # on the member daemon's own loop
            store.put_local(name, forged_step, bytes(forged), compat)

        mallory._call(hold_forged(), 5)

        late = _late_joiner(daemons[3], config, min_replicas=4)
        info = late.restored
        assert info["source"] == "mesh", info
        assert info["writer"] in honest, info
        assert late.start_step < forged_step, info
        refused = info.get("refused") or []
        assert any(mallory.daemon.peer_id in r["writers"] for r in refused), info
        assert info["vouched"]["vouchers"] >= 1, info
        # The state it took is an honest replica's: near theirs, far from the noise.
        mine = torch.cat([b.flatten() for b in late.buckets])
        theirs = torch.cat([b.flatten() for b in attached[0].buckets])
        assert float((mine - theirs).norm() / theirs.norm()) < 0.5
        assert not errors, errors
        late.close()
    finally:
        stop.set()
        for t in loops:
            t.join(30)
        for sync in attached.values():
            sync.close()
        for d in daemons:
            d.stop(leave=False)


def _late_joiner(daemon: Any, config: Config, min_replicas: int) -> Any:
    """A joiner with a model of its own (seed 99), attached to run "t" on ``daemon``."""
    import torch  # noqa: PLC0415

    from ciuic_p2p.train.attach import attach  # noqa: PLC0415
    from tests.train.test_elastic import _model  # noqa: PLC0415

    model = _model(99)
    return attach(model, torch.optim.SGD(model.parameters(), lr=0.02), run="t", daemon=daemon,
                  config=config, min_replicas=min_replicas, join_timeout_s=60)  # fmt: skip
