"""The engine replica: a Ray Serve deployment wrapping one vLLM engine (prefix caching + KV events).

Each replica's KV-cache events reach routers through its own relay (`kvmesh.cluster.event_relay`), and
`record_routing_stats()` tells routers where (Serve polls it and hands the dict to every router as
`RunningReplica.routing_stats`). vLLM's publisher binds ipc sockets in a folder only this user can open
(its `BlockStored` events carry the prompt's token ids); the relay re-publishes only what routing needs,
over ZMQ CURVE (`kvmesh.cluster.secure_channel`), on a PUB + replay ROUTER bound to the node's address,
so any number of routers (one per ingress replica) connect to it.

Request (a plain dict, built by the ingress; the router reads `prompt_token_ids` and `cache_salt`):
    {"request_id": str, "prompt_token_ids": [int], "cache_salt": str | None,
     "params": {max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, min_tokens}}
Stream of chunks (dicts): {"text", "token_ids", "finish_reason", "stop_reason", "num_cached_tokens",
    "prompt_tokens", "replica"}; errors are raised (the ingress maps them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.cluster.thread_names import name_loop_thread
from kvmesh.deployments.config import engine_config, engine_dtype, hf_model_config, resolve_model
from kvmesh.deployments.engine_driver import EngineBroken
from kvmesh.kvstore.tiers import TierConfig  # configuration only: no processes, no Ray (kvstore/tiers.py)

log = logging.getLogger("ray.serve.kvmesh")  # Serve routes "ray.serve" logs to the replica log files

SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",  # set by some tool-call parsers only (deployments/tool_calls.py)
    "logit_bias",
    "allowed_token_ids",  # the only tokens sampled (vLLM checks them against the vocabulary too)
    "bad_words",  # words never generated: vLLM's InputProcessor tokenises them with the engine's tokenizer
    "logprobs",  # how many top log-probabilities beside each sampled token's (deployments/logprobs.py)
    "logprob_token_ids",  # the tokens whose log-probabilities are given instead of the top ones
    "prompt_logprobs",  # the same for each prompt token (an echoed completion's); vLLM reads no cache for it
)
EVENTS_TOPIC = "kvmesh"
# request ids a load report names at most per state: the default max_ongoing_requests. Serve hands every router
# every replica's report whenever one changes (256 replicas naming 64 ids each: 0.6 MB per router per change)
REPORTED_IDS = 64


def model_sampling_defaults(driver) -> dict:
    """The model's recommended sampling settings (its generation_config.json: temperature, top_p, ...), for
    what a request leaves out, as vLLM's own server fills them: an instruct model sampled at vLLM's neutral
    defaults answers differently from how it was tuned to. Its output length (`max_new_tokens`) is not among
    them: every request comes with max_tokens set by the ingress, which applies that default itself
    (`ingress.model_default_max_tokens`) where vLLM's get_max_tokens does, since it checks min_tokens against it
    and caps it to the context the prompt leaves."""
    try:
        diff = driver.engine.vllm_config.model_config.get_diff_sampling_param()
    except Exception:  # a driver without a vLLM engine's config (tests): vLLM's neutral defaults
        return {}
    return {k: v for k, v in diff.items() if k in SAMPLING_KEYS and k != "max_tokens"}


def effective_block_size(driver, configured: int) -> int:
    """The block size vLLM runs with (`cache_config.block_size`), or `configured` when it cannot be read. Why:
    vLLM may change the configured size (hybrid models, some attention backends), and its KV events' hashes
    cover blocks of the size it runs with: the size routers must hash requests with, so the one to report."""
    try:
        size = driver.engine.vllm_config.cache_config.block_size
    except Exception:  # a driver without a vLLM engine's config (tests)
        return configured
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else configured


def kv_cache_dtype(driver, cfg: dict) -> str:
    """The dtype of the KV cache vLLM runs with: its cache dtype where one is set (fp8), else the model's dtype
    as it runs (`model_config.dtype`, "auto" resolved). Why: it sizes a KV block in bytes, and so the host
    tier in blocks; the configured "auto" says nothing of the width (the tiny model runs float32, others 16-bit).
    Without a vLLM engine's config to read (tests) it is the dtype kvmesh hands vLLM (`engine_dtype`)."""
    try:
        vllm_config = driver.engine.vllm_config
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        model_dtype = vllm_config.model_config.dtype
    except Exception:  # a driver without a vLLM engine's config
        return engine_dtype(cfg["model"], cfg["dtype"])
    if cache_dtype.startswith("fp8"):
        return "fp8"
    return str(model_dtype).removeprefix("torch.")


def lmcache_connection(cfg: dict) -> tuple[dict | None, TierConfig | None]:
    """(the kv_transfer_config this engine should use, the tier config of the node's LMCache server behind it).

    An explicit `kv_transfer_config` in the engine config wins (passed straight to vLLM; no server known).
    Otherwise, when `lmcache` is set, kvstore/ finds (or starts) this node's LMCache server and returns the
    matching LMCacheMPConnector config and the settings that server runs with: a server started earlier
    keeps its own (`node_server.connect_node_server`). (None, None) when no KV connector is wanted.
    """
    if cfg.get("kv_transfer_config"):
        return dict(cfg["kv_transfer_config"]), None
    if cfg.get("lmcache"):
        from kvmesh.kvstore.node_server import engine_lmcache  # finds or starts the node's server

        return engine_lmcache(cfg["lmcache"], block_size=cfg["block_size"])
    return None, None


_L1_WARNED: set[tuple[str, float, float]] = set()  # (node, server's L1 GB, this config's) warned of already


def warn_if_server_l1_differs(node_id: str, asked: dict, server: TierConfig) -> bool:
    """Log once (per node and sizes) that the node's LMCache server holds another L1 size than this engine's
    config asks for; True when they differ. The routers model the server's (`tier_info`)."""
    wanted = TierConfig.from_dict(asked).l1_size_gb
    if float(wanted) == float(server.l1_size_gb):
        return False
    key = (node_id, float(server.l1_size_gb), float(wanted))
    if key not in _L1_WARNED:
        _L1_WARNED.add(key)
        log.warning(
            "node %s already runs an LMCache server with l1_size_gb=%s; this engine's config asks for "
            "l1_size_gb=%s. The node's server keeps its own L1 size until it is restarted (on KubeRay a new "
            "RayCluster: apply the manifest `kvmesh k8s render` wrote; locally stop the app and start it "
            "again), and the routers model its %s GB host tier for this node meanwhile",
            node_id[:12],
            server.l1_size_gb,
            wanted,
            server.l1_size_gb,
        )
    return True


PRIVATE_DIR_PREFIX = "kvmesh-engine-"


def remove_dead_private_dirs(root: str = "/tmp") -> int:
    """Remove replicas' private folders (kvmesh-engine-<pid>-*) whose process is gone: a replica killed by
    Serve or SIGKILL never runs __del__. Returns how many were removed."""
    from kvmesh.kvstore.private_dir import remove_dead_owners_dirs

    return remove_dead_owners_dirs(PRIVATE_DIR_PREFIX, root)


@contextlib.contextmanager
def vllm_files_in(folder: str):
    """vLLM leaves files behind in the temp folder: each engine's torch.distributed file store
    (`vllm_dist_<hex>`) and, with a separate engine-core process, its IPC sockets. While the engine
    starts, both go to `folder` (the replica's private folder, removed with it) instead of /tmp: this
    process's temp folder, and TMPDIR for an engine-core process (AsyncLLM's), which makes its own."""
    saved, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = folder
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    os.environ["TMPDIR"] = folder
    try:
        yield
    finally:
        tempfile.tempdir = saved
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


def logprob_rows(positions) -> list[list[tuple[int, float, int | None, str | None]]]:
    """vLLM's sample log-probabilities (per new token, a dict of token id -> Logprob: the sampled one first,
    then the top ones by rank) as plain data for the ingress, in the engine's order: (id, logprob, rank, its
    decoded text)."""
    return [[(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in (step or {}).items()] for step in positions]


class EngineReplica:
    """One vLLM engine. Methods take token ids: tokenizing happens once, in the ingress."""

    def __init__(self, engine: dict | None = None):
        import ray

        self.cfg = engine_config(engine)
        if self.cfg["num_gpus"] == 0 and self.cfg.get("kv_cache_space_gb"):
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg["kv_cache_space_gb"])
        from kvmesh.deployments.loopback_serve import bind_replica_grpc_to_loopback

        bind_replica_grpc_to_loopback()  # before Serve starts this replica's gRPC server
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit use)
            self.replica_id = f"local-{uuid.uuid4().hex[:8]}"
        if ray.is_initialized():  # never start a Ray cluster just to learn our address
            self.node_id = ray.get_runtime_context().get_node_id()
            node_ip = ray.util.get_node_ip_address()
        else:
            self.node_id, node_ip = "node-0", "127.0.0.1"
        self.model_path = resolve_model(self.cfg["model"])
        self.kv_events_endpoint = self.replay_endpoint = None
        self.events_relay: Any = None
        remove_dead_private_dirs()
        from kvmesh.kvstore.private_dir import owned_temp_dir

        # mkdtemp is 0700: no other user can open what is in it; /tmp keeps socket paths within ipc's ~107 bytes
        self._private_dir: str | None = owned_temp_dir(PRIVATE_DIR_PREFIX, "/tmp")
        from kvmesh.deployments.engine_driver import build_engine_args, make_driver

        with self._released_on_error():
            kv_events = self._start_event_relay(node_ip) if self.cfg["kv_events"] else None
            kv_transfer, server_tiers = lmcache_connection(self.cfg)
            args = build_engine_args(self.cfg, self.model_path, kv_events, kv_transfer)
            with vllm_files_in(self._private_dir):
                self.driver = make_driver(self.cfg["engine_mode"], args, fail_step_after=self.cfg["fail_step_after"])
        self.num_blocks = self.driver.num_blocks()
        self.block_size = effective_block_size(self.driver, self.cfg["block_size"])
        if self.block_size != self.cfg["block_size"]:
            log.warning(
                "replica %s: vLLM runs with KV blocks of %d tokens, not the configured %d: routers must use %d",
                self.replica_id,
                self.block_size,
                self.cfg["block_size"],
                self.block_size,
            )
        self.sampling_defaults = model_sampling_defaults(self.driver)
        self.stats_errors = 0  # failed reads of the engine's internals for routing stats
        self.tier_info = None  # what routers need to model this node's LMCache tiers (kvstore/tiers.py)
        if server_tiers is not None:  # the node's server as it runs, which may not be as this config asks
            from kvmesh.kvstore.tiers import TierConfigError, kv_bytes_per_block, tier_routing_info

            warn_if_server_l1_differs(self.node_id, self.cfg["lmcache"], server_tiers)
            # the blocks and the dtype vLLM runs with, which may not be the configured ones
            bytes_per_block = kv_bytes_per_block(
                hf_model_config(self.model_path), self.block_size, kv_cache_dtype(self.driver, self.cfg)
            )
            try:
                self.tier_info = tier_routing_info(server_tiers, self.block_size, bytes_per_block)
            except TierConfigError:
                # vLLM chose blocks that do not divide the server's chunks (the config's were checked): raised
                # here, past the driver's release-on-error guard, it failed the replica at every restart. The
                # engine serves; the routers model no LMCache tier for it (LMCache stores whole chunks only)
                log.warning(
                    "replica %s: vLLM's KV blocks of %d tokens do not divide the node's LMCache chunk_size %d: "
                    "routers model no LMCache tier for this replica",
                    self.replica_id,
                    self.block_size,
                    server_tiers.chunk_size,
                )
        log.info(
            "engine replica %s ready: model=%s blocks=%d events=%s",
            self.replica_id,
            self.model_path,
            self.num_blocks,
            self.kv_events_endpoint,
        )

    def _start_event_relay(self, node_ip: str) -> dict:
        """vLLM's publisher on private ipc sockets; the relay re-publishes them for routers (over CURVE)."""
        from kvmesh.cluster.event_relay import EventRelay
        from kvmesh.cluster.secure_channel import channel_keys

        keys = channel_keys()  # fail before the engine loads when the deployment has no channel secret
        raw, raw_replay = f"ipc://{self._private_dir}/pub", f"ipc://{self._private_dir}/replay"
        self.events_relay = EventRelay(raw, raw_replay, bind_host=node_ip, keys=keys, topic=EVENTS_TOPIC)
        self.kv_events_endpoint = self.events_relay.endpoint
        self.replay_endpoint = self.events_relay.replay_endpoint
        return {"endpoint": raw, "replay_endpoint": raw_replay, "topic": EVENTS_TOPIC}

    def _release(self) -> None:
        """Close the event relay and remove the private folder (vLLM's sockets and files in it)."""
        relay, self.events_relay = getattr(self, "events_relay", None), None
        if relay is not None:
            relay.close()
        private_dir, self._private_dir = getattr(self, "_private_dir", None), None
        if private_dir:
            shutil.rmtree(private_dir, ignore_errors=True)

    @contextlib.contextmanager
    def _released_on_error(self):
        try:
            yield
        except BaseException:
            self._release()
            raise

    def _sampling_params(self, params: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs = {**getattr(self, "sampling_defaults", {})}
        kwargs.update({k: params[k] for k in SAMPLING_KEYS if params.get(k) is not None})
        if params.get("structured_outputs"):  # a grammar the answer is decoded under (structured_outputs.py)
            from kvmesh.deployments.structured_outputs import engine_params

            kwargs["structured_outputs"] = engine_params(params["structured_outputs"])
        return SamplingParams(output_kind=RequestOutputKind.DELTA, **kwargs)

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        name_loop_thread()
        prompt: dict[str, Any] = {"prompt_token_ids": list(request["prompt_token_ids"])}
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        params = self._sampling_params(request.get("params") or {})
        rid = request.get("request_id") or uuid.uuid4().hex
        n_prompt = len(prompt["prompt_token_ids"])
        try:
            # its priority (lower first) orders it only where the engine schedules by priority
            async for out in self.driver.generate(prompt, params, rid, priority=int(request.get("priority") or 0)):
                comp = out.outputs[0] if out.outputs else None
                yield {
                    "text": comp.text if comp else "",
                    "token_ids": list(comp.token_ids) if comp else [],
                    "finish_reason": comp.finish_reason if comp and out.finished else None,
                    # what ended it: a stop string (str), a stop token's id, None for EOS or a length; the ingress
                    # needs it to leave a stop token's text out of a moved stream's text, as vLLM does
                    "stop_reason": comp.stop_reason if comp and out.finished else None,
                    "num_cached_tokens": int(out.num_cached_tokens or 0),
                    "prompt_tokens": n_prompt,
                    "replica": self.replica_id,
                    "logprobs": logprob_rows(comp.logprobs) if comp and comp.logprobs is not None else None,
                    # all at once, with the first output (vLLM's delta outputs); the first token's is empty
                    "prompt_logprobs": logprob_rows(out.prompt_logprobs) if out.prompt_logprobs else None,
                }
        except Exception as exc:
            if self.driver.healthy() and not isinstance(exc, EngineBroken):
                raise
            # the engine itself failed: name this replica, so the ingress moves the request elsewhere
            # and the routers stop sending here before Serve's health check replaces the replica
            raise EngineBroken(f"engine of replica {self.replica_id} failed: {exc!r}", self.replica_id) from None

    async def generate_full(self, request: dict) -> dict:
        """Non-streaming form of `generate`: one reply instead of a chunk per token (one Serve hop
        fewer per token). `ttft_s` is measured here, from engine admission to the first output;
        `after_first_output_s` from the first output to the reply: the ingress takes it from its own
        end-to-end time to get the time to first token a stream would have shown (no clocks compared
        across processes)."""
        t0 = time.perf_counter()
        ttft = t_first = None
        text, token_ids, last = [], [], None
        logprobs: list | None = None  # only when the request asked for them
        prompt_logprobs: list | None = None
        async for chunk in self.generate(request):
            if t_first is None:
                t_first = time.perf_counter()
                ttft = t_first - t0
            text.append(chunk["text"])
            token_ids.extend(chunk["token_ids"])
            if chunk.get("logprobs") is not None:
                logprobs = [] if logprobs is None else logprobs
                logprobs.extend(chunk["logprobs"])
            if chunk.get("prompt_logprobs") is not None:
                prompt_logprobs = (prompt_logprobs or []) + chunk["prompt_logprobs"]
            last = chunk
        if last is None or t_first is None:  # generate raises when the engine fails, so this is not expected
            raise RuntimeError(f"engine returned no output for request {request.get('request_id')!r}")
        after_first = time.perf_counter() - t_first
        return {
            **last,
            "text": "".join(text),
            "token_ids": token_ids,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "ttft_s": ttft,
            "after_first_output_s": after_first,
        }

    def record_routing_stats(self) -> dict:
        """Serve calls this on a worker thread (a sync method) while the replica's loop moves requests
        from queued to running: the load fields come from one `report` of the driver's counter, taken
        under its lock, so the counts and the ids behind them always agree."""
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),  # the replica's process, for operators and fault tests (kill -9)
            # queued, running, aborted, and which requests the first two are (up to REPORTED_IDS each; beyond,
            # none: routers then take the counts as they are): a router takes off what it knows has started or
            # ended since this report was made
            **self.driver.load.report(REPORTED_IDS),
            "steps": self.driver.steps,  # requests over steps: how much each engine step batched
            "kv_usage": self._kv_usage(),
            "stats_errors": self.stats_errors,
            "healthy": self.driver.healthy(),  # a broken engine: routers stop choosing this replica
            "kv_events_endpoint": self.kv_events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "events_auth": "curve" if self.events_relay is not None else None,  # routers connect with channel keys
            "events_topic": EVENTS_TOPIC,
            "node_id": self.node_id,
            "block_size": getattr(self, "block_size", self.cfg["block_size"]),  # the one vLLM runs with
            "num_blocks": self.num_blocks,
            "hash_algo": self.cfg["hash_algo"],
            "tiers": self.tier_info,
            # prompt tokens loaded through LMCache so far: the delivered hits that came from the tiers
            "external_hit_tokens": self.driver.external_hit_tokens,
        }

    def _kv_usage(self) -> float:
        """KV usage from vLLM's internals. If they change shape, routing keeps the replica's endpoints and
        load (only this figure is lost): the failure is counted (`stats_errors`, exported by the ingress
        as kvmesh_replica_stats_errors_total) and logged, and every later report tries again."""
        try:
            return self.driver.kv_usage()
        except Exception:
            self.stats_errors += 1
            if self.stats_errors == 1 or self.stats_errors % 100 == 0:
                log.exception(
                    "replica %s cannot read its KV usage (%d times); routing goes on without it",
                    self.replica_id,
                    self.stats_errors,
                )
            return 0.0

    async def info(self) -> dict:
        return {**self.record_routing_stats(), "model_path": self.model_path, "driver": type(self.driver).__name__}

    async def reset_prefix_cache(self) -> dict:
        """Drop the engine's prefix cache (vLLM refuses while requests hold blocks: `reset` False); the
        ingress's `POST /kvmesh/reset_prefix_cache` broadcasts it to every replica."""
        return {"replica": self.replica_id, "reset": bool(await self.driver.reset_prefix_cache())}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine died (the step thread or the EngineCore process)."""
        if not self.driver.healthy():
            raise RuntimeError("vLLM engine is not running")

    def __del__(self):
        drv = getattr(self, "driver", None)
        if drv is not None:
            try:
                drv.shutdown()
            except Exception:
                pass
        self._release()
