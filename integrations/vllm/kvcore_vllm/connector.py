"""``KVCoreConnector``: vLLM's KV connector API over any kvcore backend.

Select it with one config line::

    --kv-transfer-config '{"kv_connector": "KVCoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "file", "backend_config": {"root": "/nvme/kv"}}}'

vLLM creates one instance per role: in the scheduler process (``KVConnectorRole.SCHEDULER``,
see :mod:`kvcore_vllm.scheduler`) and in each worker (``WORKER``, see :mod:`kvcore_vllm.worker`).
This class only routes vLLM's calls to the side that serves them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcore_vllm.config import load_settings
from kvcore_vllm.metadata import StepMetadata
from kvcore_vllm.scheduler import SchedulerSide
from kvcore_vllm.stats import CounterSet, KVCoreConnectorStats
from kvcore_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KVCoreConnector"]

log = logging.getLogger("vllm.kvcore_vllm.connector")


@contextlib.contextmanager
def _timed(counters: CounterSet, name: str, **also: float) -> Iterator[None]:
    """Add the block's duration to ``name``: what the connector costs vLLM's step loop."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        counters.add(**{name: time.perf_counter() - t0}, **also)


class KVCoreConnector(KVConnectorBase_V1, SupportsHMA):
    """A persistent prefix-cache tier for vLLM, stored by a kvcore backend.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): hybrid models keep it on, and
    every KV cache group is stored (:mod:`kvcore_vllm.scheduler`).
    """

    @property
    def requires_kv_delivery(self) -> bool:
        # a save that is dropped is a future cache miss, nothing more
        return False

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KVCoreConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        transfer_config = vllm_config.kv_transfer_config
        self.settings = load_settings(transfer_config.kv_connector_extra_config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if transfer_config.kv_load_failure_policy != self.settings.load_failure_policy:
                # vLLM reads the policy right after building this connector. vLLM's default
                # ("fail") would turn every miss found at load time into a failed request;
                # for a cache tier that is a recomputation.
                log.info(
                    "KVCoreConnector: kv_load_failure_policy %r -> %r (blocks that fail to "
                    "load are recomputed)",
                    transfer_config.kv_load_failure_policy,
                    self.settings.load_failure_policy,
                )
                transfer_config.kv_load_failure_policy = self.settings.load_failure_policy
            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.settings)
        else:
            self.worker_side = WorkerSide(vllm_config, kv_cache_config, self.settings)

    # -- scheduler side --------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "scheduler-side call on a worker connector"
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "worker-side call on a scheduler connector"
        return self.worker_side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds"):
            return side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds"):
            side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds", scheduler_steps=1):
            return side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds"):
            side.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds"):
            return side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        side = self._scheduler()
        with _timed(side.counters, "scheduler_hook_seconds"):
            return side.request_finished_all_groups(request, block_ids)

    # -- worker side -----------------------------------------------------------------------

    def _meta(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata), f"unexpected connector metadata {type(meta)}"
        return meta

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StepMetadata) and kv_connector_metadata.preempted:
            self._worker().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.step_started()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta.loads:  # loading is the tier's work, not overhead: counted as load_seconds
            self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the step, in wait_for_save

    def wait_for_save(self) -> None:
        side = self._worker()
        side.step_computed()  # the forward pass ended just before this call
        with _timed(side.counters, "worker_hook_seconds", worker_steps=1):
            side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        side = self._worker()
        with _timed(side.counters, "worker_hook_seconds"):
            return side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``get_finished`` plus the background loads that failed (vLLM recomputes them)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        side = self._worker()
        with _timed(side.counters, "worker_hook_seconds"):
            done, loaded, failed = side.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=done, finished_recving=loaded, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        side = self._worker()
        with _timed(side.counters, "worker_hook_seconds"):
            return side.take_events()

    def take_events(self) -> Iterable[Any]:
        """The store's KV events (vLLM publishes them beside the engine's own)."""
        side = self.scheduler_side
        if side is None or side.events is None:
            return ()
        return side.events.take()

    # -- both ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is not None:
            with _timed(self.worker_side.counters, "worker_hook_seconds"):
                data = self.worker_side.take_stats()
        elif self.scheduler_side is not None:
            data = self.scheduler_side.counters.take()
        else:
            return None
        return KVCoreConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVCoreConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
