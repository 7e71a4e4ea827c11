"""`KVTierConnector` as vLLM builds it: constructing the class gives the role's own object,
which is an instance of the class vLLM named (vLLM and its plugins may check `isinstance`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from connector.vllm import KVTierConnector  # noqa: E402
from connector.vllm.scheduler_role import VllmSchedulerConnector  # noqa: E402
from connector.vllm.vllm_api import KVConnectorRole, SupportsHMA  # noqa: E402
from connector.vllm.worker_role import VllmWorkerConnector  # noqa: E402


@pytest.mark.parametrize(("role", "kind"), [(KVConnectorRole.SCHEDULER, VllmSchedulerConnector),
                                            (KVConnectorRole.WORKER, VllmWorkerConnector)])
def test_each_role_is_a_kvtier_connector(role: KVConnectorRole, kind: type) -> None:
    made = KVTierConnector.__new__(KVTierConnector, None, role)  # vLLM's call then runs kind.__init__
    assert type(made) is kind
    assert isinstance(made, KVTierConnector) and isinstance(made, SupportsHMA)


def test_the_other_roles_hooks_refuse_by_name() -> None:
    scheduler = KVTierConnector.__new__(KVTierConnector, None, KVConnectorRole.SCHEDULER)
    with pytest.raises(RuntimeError, match="wait_for_save is a worker-role hook"):
        scheduler.wait_for_save()
    worker = KVTierConnector.__new__(KVTierConnector, None, KVConnectorRole.WORKER)
    with pytest.raises(RuntimeError, match="build_connector_meta is a scheduler-role hook"):
        worker.build_connector_meta(None)
