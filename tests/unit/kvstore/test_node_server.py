"""The router's tier watch (kvstore/node_server.watch_tier_health) over fake node-server handles: a node
whose LMCache server is dead, unreachable or gone leaves the router's tier view in one round."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from kvmesh.cluster.index import PrefixIndex
from kvmesh.cluster.tier_tracker import TierTracker
from kvmesh.kvstore import node_server
from kvmesh.kvstore.tiers import TierConfigError


class _Method:
    def __init__(self, reply):
        self.reply = reply

    def remote(self):
        async def call():
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

        return call()


def _actor(reply) -> SimpleNamespace:
    return SimpleNamespace(health=_Method(reply))


def _healthy(serving: bool = True) -> dict:
    return {"serving": serving, "shared_tier_up": True, "restarts": 0}


def test_dead_unreachable_and_vanished_node_servers_leave_the_tier_view(monkeypatch):
    index = PrefixIndex()
    tracker = TierTracker(index)
    for node in ("up", "dead", "unreachable", "gone"):
        index.add_replica(f"r-{node}", node_id=node)
        tracker.set_node(node, has_shared_tier=True, host_capacity_blocks=100)
        tracker.record_prefill(f"r-{node}", [hash(node) + k for k in range(4)])
    actors = {
        "up": _actor(_healthy()),
        "dead": _actor(_healthy(serving=False)),  # the server process was killed; the actor answers
        "unreachable": _actor(RuntimeError("actor died with its node")),
    }  # "gone": no actor any more (its node left the cluster)
    monkeypatch.setattr(node_server, "node_servers", lambda: actors)
    stop = asyncio.Event()

    async def one_round():
        watch = asyncio.create_task(node_server.watch_tier_health(tracker, interval_s=0.01, stop=stop))
        await asyncio.sleep(0.2)
        stop.set()
        await watch

    asyncio.run(one_round())
    assert set(tracker.nodes()) == {"up"}
    assert tracker.counters["nodes_dropped"] == 3
    # the dropped nodes' host copies no longer count for their replicas; the shared copies still do
    assert index.match([hash("dead") + k for k in range(4)]) == {r: (0, 0, 4) for r in index.replicas()}
    assert index.match([hash("up") + k for k in range(4)])["r-up"] == (0, 4, 4)


def _watch_rounds(tracker, rounds) -> None:
    """Run the watch over a sequence of rounds: each a (node -> health reply) map, and what happens between
    two looks (a callable: a request's routing stats, a prefill)."""
    stop = asyncio.Event()
    actors: dict = {}

    async def run():
        watch = asyncio.create_task(node_server.watch_tier_health(tracker, interval_s=0.02, stop=stop))
        for replies, between in rounds:
            actors.clear()
            actors.update({node: _actor(reply) for node, reply in replies.items()})
            await asyncio.sleep(0.1)
            between()
        stop.set()
        await watch

    node_server_nodes = node_server.node_servers
    node_server.node_servers = lambda: dict(actors)
    try:
        asyncio.run(run())
    finally:
        node_server.node_servers = node_server_nodes


def test_a_node_whose_server_is_down_stays_out_of_the_tier_view_until_it_serves():
    """Every request's routing stats declare the engine's node again (`set_node`): that must not bring back
    a node whose server is down, or prefills meanwhile count as stored in a tier that is not there."""
    index = PrefixIndex()
    tracker = TierTracker(index)
    index.add_replica("r", node_id="n")

    def declare():  # what the router does on every request
        tracker.set_node("n", has_shared_tier=True, host_capacity_blocks=100)

    declare()
    _watch_rounds(tracker, [({"n": _healthy(serving=False)}, declare)])
    assert "n" not in tracker.nodes() and tracker.record_prefill("r", [1, 2, 3]) == 0
    _watch_rounds(tracker, [({"n": _healthy()}, declare)])
    assert "n" in tracker.nodes() and tracker.record_prefill("r", [1, 2, 3]) == 3


def test_a_shared_tier_that_went_down_and_came_back_between_two_looks_is_forgotten():
    """A Redis restarted empty between two of the watch's looks: the node's watchdog counted the loss, and
    what the router marked in the shared tier is gone."""
    index = PrefixIndex()
    tracker = TierTracker(index)
    for node in ("a", "b"):
        index.add_replica(f"r-{node}", node_id=node)
        tracker.set_node(node, has_shared_tier=True, host_capacity_blocks=100)
    tracker.record_prefill("r-a", [1, 2, 3])
    assert index.match([1, 2, 3])["r-b"] == (0, 0, 3)
    before = {**_healthy(), "shared_tier_losses": 0}
    after = {**_healthy(), "shared_tier_losses": 1}  # seen down by the node's watchdog, up again now
    _watch_rounds(tracker, [({"a": before, "b": before}, lambda: None), ({"a": after, "b": before}, lambda: None)])
    assert index.match([1, 2, 3])["r-b"] == (0, 0, 0) and tracker.shared_up


class _RecordingServer:
    """Stands in for LMCacheServer in NodeServerCore: records where its output was to go."""

    made: list[dict] = []

    def __init__(self, config, log_path=None, inherit_output=False):
        _RecordingServer.made.append({"log_path": log_path, "inherit_output": inherit_output})

    def start(self):
        return ("127.0.0.1", 1)


def test_without_a_log_folder_the_node_server_writes_nothing_to_the_temp_folder(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(node_server, "LMCacheServer", _RecordingServer)
    monkeypatch.delenv("KVMESH_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    _RecordingServer.made.clear()
    cfg = {"l1_size_gb": 0.05, "chunk_size": 64, "watch_interval_s": 0}
    node_server.NodeServerCore(cfg)
    assert _RecordingServer.made[-1] == {"log_path": None, "inherit_output": True}
    assert list((tmp_path / "temp").iterdir()) == []
    monkeypatch.setenv("KVMESH_LOG_DIR", str(tmp_path / "logs"))
    node_server.NodeServerCore(cfg)
    path = _RecordingServer.made[-1]["log_path"]
    assert path is not None and path.parent == tmp_path / "logs" and path.name.startswith("lmcache-server-")


def test_an_inheriting_server_writes_to_its_owners_stderr(capfd, monkeypatch):
    from kvmesh.kvstore.lmcache_server import LMCacheServer
    from kvmesh.kvstore.tiers import TierConfig

    config = TierConfig.from_dict({"l1_size_gb": 0.05, "chunk_size": 64})
    script = "import sys; print('served-out'); print('served-err', file=sys.stderr)"
    for inherit in (True, False):
        server = LMCacheServer(config, inherit_output=inherit, preexec_fn=None)
        monkeypatch.setattr(server, "command", lambda: [sys.executable, "-c", script])
        server.launch()
        assert server.proc is not None and server.proc.wait(timeout=30) == 0
        out, err = capfd.readouterr()
        seen = out + err
        if inherit:
            assert "served-out" in seen and "served-err" in seen
            assert "stderr" in server.output_where()
        else:
            assert "served-out" not in seen and "served-err" not in seen
            assert server.output_where() == "output discarded"


def test_a_node_that_leaves_while_its_server_is_down_is_not_kept_for_good():
    """Node ids are new on every machine: one held down and then gone from the cluster leaves the tracker."""
    tracker = TierTracker(PrefixIndex())
    tracker.set_node("flaky", has_shared_tier=True, host_capacity_blocks=100)
    _watch_rounds(
        tracker,
        [
            ({"flaky": RuntimeError("no answer")}, lambda: None),  # held down
            ({}, lambda: None),  # then its node left the cluster
        ],
    )
    assert tracker.watched_nodes() == set()


def test_a_node_whose_server_actor_is_gone_but_whose_engines_serve_stays_down():
    """Its engines' routing stats declare the node again on every request: with no server there, the router
    must not model a host tier it cannot read."""
    index = PrefixIndex()
    tracker = TierTracker(index)
    index.add_replica("r1", node_id="n1")

    def stats_arrive():
        tracker.set_node("n1", has_shared_tier=True, host_capacity_blocks=100)

    stats_arrive()
    _watch_rounds(tracker, [({"n1": RuntimeError("no answer")}, stats_arrive), ({}, stats_arrive)])
    assert "n1" not in tracker.nodes()


class _Server:
    """A node-server actor stand-in whose node can freeze: a health call made while frozen is answered only once
    the node resumes (with the reply of that moment), as Ray delivers a call to a SIGSTOPped actor."""

    def __init__(self, reply: dict):
        self.reply = reply
        self.frozen = False
        self.asked = 0
        self.pending = 0  # calls made and neither answered nor given up on
        self.health = SimpleNamespace(remote=self._call)

    async def _call(self) -> dict:
        self.asked += 1
        self.pending += 1
        try:
            while self.frozen:
                await asyncio.sleep(0.005)
            return dict(self.reply)
        finally:
            self.pending -= 1


def _watching(monkeypatch, tracker, servers: dict, scenario, timeout_s: float = 0.2) -> None:
    """Run `scenario` (a coroutine function) while the watch runs over `servers` (node -> _Server)."""
    monkeypatch.setattr(node_server, "node_servers", lambda: dict(servers))

    async def run():
        stop = asyncio.Event()
        watch = asyncio.create_task(
            node_server.watch_tier_health(tracker, interval_s=0.02, stop=stop, timeout_s=timeout_s)
        )
        try:
            await scenario()
        finally:
            stop.set()
            await watch

    asyncio.run(run())


async def _until(condition, within: float = 2.0, between=lambda: None) -> float | None:
    """Seconds until `condition()` holds (None if not `within`); `between` runs at each look."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < within:
        between()
        if condition():
            return loop.time() - start
        await asyncio.sleep(0.005)
    return None


def _one_node(host_blocks: int = 3):
    """A node "n" with replicas "r" and "r2" and an LMCache host tier holding one prompt of `host_blocks`."""
    index = PrefixIndex()
    tracker = TierTracker(index)
    index.add_replica("r", node_id="n")
    index.add_replica("r2", node_id="n")

    def declare():  # what the router does with every request's routing stats
        tracker.set_node("n", has_shared_tier=False, host_capacity_blocks=100)

    declare()
    tracker.record_prefill("r", list(range(1, host_blocks + 1)))
    return index, tracker, declare


def test_a_frozen_node_that_answers_again_with_the_same_server_keeps_its_host_tier(monkeypatch):
    """SIGSTOP of a node's processes, then SIGCONT: its LMCache server kept its contents, so what the router
    predicts from its host tier afterwards is what it predicted before, not a cold start."""
    index, tracker, declare = _one_node()
    server = _Server(_healthy())
    prompt = [1, 2, 3]

    async def scenario():
        assert await _until(lambda: server.asked >= 2)  # answered once at least
        server.frozen = True
        assert await _until(lambda: "n" not in tracker.nodes(), between=declare) is not None
        assert tracker.loadable(index.match(prompt))["r2"] == (0, 0, 0)  # no host hits while it does not answer
        asked = server.asked
        await asyncio.sleep(0.6)  # rounds go by: the call it owes is not repeated
        assert server.asked == asked and tracker.loadable(index.match(prompt))["r2"] == (0, 0, 0)
        server.frozen = False
        assert await _until(lambda: "n" in tracker.nodes(), between=declare) is not None

    _watching(monkeypatch, tracker, {"n": server}, scenario)
    assert tracker.loadable(index.match(prompt))["r2"] == (0, 3, 3)
    assert tracker.counters["nodes_unanswering"] == 1 and tracker.counters["nodes_restored"] == 1


def test_a_frozen_node_that_answers_with_another_server_loses_its_host_tier(monkeypatch):
    for other in ({"restarts": 1}, {"instance": "a new actor"}, {"serving": False}):
        index, tracker, declare = _one_node()
        server = _Server(_healthy())

        async def scenario(server=server, other=other):
            assert await _until(lambda: server.asked >= 2)
            server.frozen = True
            assert await _until(lambda: "n" not in tracker.nodes())
            server.reply = {**server.reply, **other}
            asked = server.asked
            server.frozen = False
            assert await _until(lambda: server.asked > asked)  # the owed call answered, the next one asked
            declare()

        _watching(monkeypatch, tracker, {"n": server}, scenario)
        assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 0, 0), other
        assert tracker.counters["nodes_restored"] == 0 and tracker.stats["tier_nodes_unanswering_now"] == 0, other


def test_a_frozen_node_does_not_delay_the_others(monkeypatch):
    """Asked one after the other with 5 s each, one frozen node held every other node's news back 5 s a round.
    Judged by order, not by a clock: the others' news is applied while the frozen node's call is still owed."""
    index = PrefixIndex()
    tracker = TierTracker(index)
    for node in ("frozen", "dead", "restarted"):
        index.add_replica(f"r-{node}", node_id=node)
        tracker.set_node(node, has_shared_tier=False, host_capacity_blocks=100)
        tracker.record_prefill(f"r-{node}", [hash(node) + k for k in range(4)])
    servers = {
        "frozen": _Server(_healthy()),
        "dead": _Server(_healthy(serving=False)),
        "restarted": _Server(_healthy()),
    }
    servers["frozen"].frozen = True
    frozen = servers["frozen"]

    async def scenario():
        assert await _until(lambda: "dead" not in tracker.nodes()) is not None
        # handled on its answer: the frozen node's round deadline has not passed, its call is still out
        assert "frozen" in tracker.nodes() and frozen.pending == 1
        assert await _until(lambda: "frozen" not in tracker.nodes(), within=10)  # the first round's deadline
        servers["restarted"].reply = {**_healthy(), "restarts": 1}
        asked = servers["restarted"].asked
        assert await _until(lambda: tracker.nodes()["restarted"]["host_blocks"] == 0, within=10) is not None
        # the next rounds asked the others without asking the frozen node again or giving up its owed call
        assert servers["restarted"].asked > asked and frozen.asked == 1 and frozen.pending == 1

    _watching(monkeypatch, tracker, servers, scenario, timeout_s=1.0)


def test_a_node_that_never_answers_again_is_forgotten_once_its_engines_and_actor_are_gone(monkeypatch):
    index, tracker, _ = _one_node()
    servers = {"n": _Server(_healthy())}

    async def scenario():
        assert await _until(lambda: servers["n"].asked >= 2)
        servers["n"].frozen = True
        assert await _until(lambda: tracker.stats["tier_nodes_unanswering_now"] == 1)
        for rid in ("r", "r2"):  # its replicas leave Serve's set: the router forgets them, then the node
            index.remove_replica(rid)
        tracker.drop_node("n")
        index.remove_node("n")
        await asyncio.sleep(0.1)
        servers.clear()  # Ray declares the node dead: its actor is gone
        assert await _until(lambda: not tracker.watched_nodes())

    _watching(monkeypatch, tracker, servers, scenario)
    assert tracker.stats["tier_nodes_unanswering_now"] == 0 and tracker.stats["tier_host_blocks"] == 0


def test_a_node_server_actor_replaced_between_two_looks_empties_the_host_tier(monkeypatch):
    """The node's actor died and Ray made another within a round: the new one answers, serving, its restarts at 0
    like the old one's, but its server started empty, so nothing is predicted from the old one's contents."""
    index, tracker, declare = _one_node()
    server = _Server({**_healthy(), "instance": "first actor"})

    async def scenario():
        assert await _until(lambda: server.asked >= 2)
        assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 3, 3)
        server.reply = {**server.reply, "instance": "second actor"}
        asked = server.asked
        assert await _until(lambda: server.asked > asked + 1)  # the new actor's answer was read

    _watching(monkeypatch, tracker, {"n": server}, scenario)
    assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 0, 0)
    assert tracker.counters["host_dropped_on_restart"] == 3


def test_a_node_whose_actor_was_replaced_while_a_call_was_owed_asks_the_new_actor(monkeypatch):
    """The old actor's call is owed (its node froze, then Ray made a new actor under the node's name): the new
    actor is asked at once, not only after the old call fails, and its empty server is what the router models."""
    index, tracker, declare = _one_node()
    old, new = _Server({**_healthy(), "instance": "old"}), _Server({**_healthy(), "instance": "new"})
    old._actor_id, new._actor_id = "actor-1", "actor-2"
    servers = {"n": old}

    async def scenario():
        assert await _until(lambda: old.asked >= 2)
        old.frozen = True
        assert await _until(lambda: "n" not in tracker.nodes())
        servers["n"] = new  # listed under the node now; the old call is still owed
        assert await _until(lambda: new.asked >= 1, within=1.0) is not None, "the new actor was never asked"
        assert await _until(lambda: "n" in tracker.nodes(), between=declare) is not None

    _watching(monkeypatch, tracker, servers, scenario)
    old.frozen = False
    assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 0, 0)
    assert tracker.counters["nodes_restored"] == 0


class _StubServer:
    """Stands in for LMCacheServer: an endpoint, nothing started."""

    def __init__(self, config, log_path=None, inherit_output=False):
        self.endpoint = ("ipc:///tmp/kvmesh-test/requests", 1)

    def start(self):
        return self.endpoint


class _Call:
    def __init__(self, method):
        self.method = method

    def remote(self, *args):
        return self.method(*args)  # the "object ref" is the reply itself; ray.get below hands it back


class _Handle:
    """A node server actor's handle over an in-process NodeServerCore."""

    def __init__(self, core):
        self.core = core

    def __getattr__(self, name):
        return _Call(getattr(self.core, name))


class _DetachedActors:
    """`_actor_cls()` as Ray's get_if_exists=True makes it: the first creation under a name wins, later ones
    get that actor back as it is, with the config it was created with."""

    def __init__(self):
        self.by_name: dict[str, _Handle] = {}

    def options(self, name, **_):
        actors = self.by_name

        class _Options:
            def remote(self, config, log_dir):
                if name not in actors:
                    actors[name] = _Handle(node_server.NodeServerCore(config, log_dir))
                return actors[name]

        return _Options()


def _fake_ray(monkeypatch) -> _DetachedActors:
    import ray

    actors = _DetachedActors()
    monkeypatch.setattr(node_server, "LMCacheServer", _StubServer)
    monkeypatch.setattr(node_server, "_actor_cls", lambda: actors)
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: list(refs) if isinstance(refs, list) else refs)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.delenv("KVMESH_LOG_DIR", raising=False)
    return actors


FIRST = {"l1_size_gb": 32, "chunk_size": 256, "l2": "redis://kvmesh-valkey:6379", "watch_interval_s": 0}


def test_an_engine_is_told_the_settings_of_the_server_it_connected_to(monkeypatch):
    """A node's server keeps the config it was started with: an engine started later with a bigger L1 connects
    to it as it is, and learns the server's L1 size (what the node's host tier holds), not its own."""
    _fake_ray(monkeypatch)
    first = node_server.connect_node_server(FIRST)
    later = node_server.connect_node_server({**FIRST, "l1_size_gb": 64})
    assert later.endpoint == first.endpoint == ("ipc:///tmp/kvmesh-test/requests", 1)
    assert later.config.l1_size_gb == 32 and later.config.chunk_size == 256
    assert later.config.l2 == {"type": "resp", "host": "kvmesh-valkey", "port": 6379}
    assert node_server.connect_node_server({**FIRST, "l1_size_gb": 64}).endpoint == first.endpoint
    kv, running = node_server.engine_lmcache({**FIRST, "l1_size_gb": 64}, block_size=16)
    assert running.l1_size_gb == 32
    assert kv["kv_connector_extra_config"]["lmcache.mp.host"] == first.endpoint[0]


def test_a_server_of_another_chunk_size_or_shared_tier_is_refused_saying_how_to_resolve_it(monkeypatch):
    _fake_ray(monkeypatch)
    node_server.connect_node_server({**FIRST, "l2": "redis://:s3cret-pw@kvmesh-valkey:6379"})
    for change in ({"chunk_size": 512}, {"l2": "redis://other:6379"}):
        with pytest.raises(TierConfigError) as err:
            node_server.connect_node_server({**FIRST, **change})
        message = str(err.value)
        assert "already runs an LMCache server" in message and "s3cret-pw" not in message
        assert "until it is restarted" in message
        assert "KubeRay" in message and "kvmesh k8s render" in message and "stop the app" in message


def test_the_server_actor_still_answers_the_previous_versions_shape_call(monkeypatch):
    _fake_ray(monkeypatch)
    node_server.connect_node_server(FIRST)
    core = node_server._actor_cls().by_name[node_server.actor_name("ab" * 28)].core
    assert core.shape() == {"chunk_size": 256, "l2": {"type": "resp", "host": "kvmesh-valkey", "port": 6379}}
    assert node_server.TierConfig.from_dict(core.settings()).l1_size_gb == 32


class _PreviousVersionCore:
    """A node server actor of the previous version (detached, it can outlive an upgrade): no settings() call."""

    def __init__(self, core):
        self._core = core

    def shape(self):
        return self._core.shape()

    def endpoint(self):
        return self._core.endpoint()


def test_an_engine_connects_to_a_server_of_the_previous_version_by_its_shape(monkeypatch):
    """A detached server of the previous version answers shape() but not settings(): the engine still connects
    (its own L1 size stands in for the one the older server does not tell), and a different chunk size is still
    refused, not an AttributeError that fails the engine's start."""
    actors = _fake_ray(monkeypatch)
    name = node_server.actor_name("ab" * 28)
    actors.by_name[name] = _Handle(_PreviousVersionCore(node_server.NodeServerCore(FIRST, None)))
    found = node_server.connect_node_server({**FIRST, "l1_size_gb": 64})
    assert found.endpoint == ("ipc:///tmp/kvmesh-test/requests", 1)
    assert found.config.chunk_size == 256 and found.config.l1_size_gb == 64
    with pytest.raises(TierConfigError):
        node_server.connect_node_server({**FIRST, "chunk_size": 512})


def test_a_credentials_only_difference_is_refused_saying_so_without_showing_them(monkeypatch):
    """A rotated password was refused with the same redacted l2 printed twice, as if nothing differed."""
    _fake_ray(monkeypatch)
    node_server.connect_node_server({**FIRST, "l2": "redis://:old-pw-0123@kvmesh-valkey:6379"})
    with pytest.raises(TierConfigError) as err:
        node_server.connect_node_server({**FIRST, "l2": "redis://:new-pw-4567@kvmesh-valkey:6379"})
    message = str(err.value)
    assert "credentials differ" in message and message.count("l2=") == 1
    assert "old-pw-0123" not in message and "new-pw-4567" not in message and "\n" not in message
    assert "until it is restarted" in message


def test_an_engine_waits_for_its_nodes_server_as_long_as_its_start_timeout_allows(monkeypatch):
    """A fixed 300 s wait cut off a server given a longer start_timeout_s, with a GetTimeoutError that did not
    say what had not answered or which setting to raise."""
    import ray
    from ray.exceptions import GetTimeoutError

    from kvmesh.kvstore.lmcache_server import LMCacheServerError

    _fake_ray(monkeypatch)
    waited: list[float | None] = []

    def get(refs, timeout=None):
        waited.append(timeout)
        raise GetTimeoutError("Get timed out: some object(s) not ready.")

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(LMCacheServerError) as err:
        node_server.engine_lmcache({**FIRST, "start_timeout_s": 600}, block_size=16)
    assert waited == [600 + node_server.ACTOR_START_MARGIN_S]
    message = str(err.value)
    assert "LMCache server" in message and "start_timeout_s" in message and "\n" not in message
    with pytest.raises(LMCacheServerError):
        node_server.connect_node_server(FIRST, timeout_s=5)
    assert waited[-1] == 5


def test_a_live_server_that_does_not_answer_its_scrape_is_kept_aside_not_dropped(monkeypatch):
    """`serving` is false for a live server whose metrics did not answer (hung, or too busy to): its contents
    are likely intact, so its model is kept aside and read again once the same server answers; a server whose
    process is dead is still dropped."""
    index, tracker, declare = _one_node()
    server = _Server({**_healthy(), "alive": True})

    async def scenario():
        assert await _until(lambda: server.asked >= 2)
        server.reply = {**server.reply, "serving": False}
        assert await _until(lambda: tracker.stats["tier_nodes_unanswering_now"] == 1) is not None
        assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 0, 0)
        server.reply = {**server.reply, "serving": True}
        assert await _until(lambda: "n" in tracker.nodes(), between=declare) is not None

    _watching(monkeypatch, tracker, {"n": server}, scenario)
    assert tracker.loadable(index.match([1, 2, 3]))["r2"] == (0, 3, 3)
    assert tracker.counters["nodes_restored"] == 1 and tracker.counters["nodes_dropped"] == 0
