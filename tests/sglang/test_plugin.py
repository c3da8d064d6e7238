"""The plugin route against the real sglang 0.5.23: after load_plugins() the
backend is selectable by name everywhere SGLang looks it up."""

from __future__ import annotations

import argparse

import pytest

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType  # noqa: E402


def test_transfer_backend_enum_has_hybridkv_and_keeps_builtins():
    values = {m.value for m in utils.TransferBackend}
    assert "hybridkv" in values
    assert {"mooncake", "nixl", "mori", "ascend", "fake"} <= values


def test_builtin_members_held_from_before_the_plugin_loaded_stay_equal():
    """The plugin loads in every SGLang process where hybridkv is installed, whichever backend is chosen: the
    built-in members a module imported before it loaded stay the very members SGLang looks up after (a
    replaced enum made them unequal: `backend == TransferBackend.NIXL` turned False)."""
    from tests.sglang import pd_peer

    r = pd_peer.Rank()
    try:
        got = r.call("backend_enum_after_plugins")
    finally:
        r.close()
    assert got == dict(same_class=True, identical=True, equal=True, hybridkv="HYBRIDKV", members=6)


def test_get_kv_class_returns_ours_for_every_class_type():
    from hybridkv.connectors.sglang import bootstrap, conn, receiver, sender
    from sglang.srt.disaggregation.base.conn import KVArgs

    backend = utils.TransferBackend("hybridkv")
    expected = {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: conn.HybridKVManager,
        KVClassType.SENDER: sender.HybridKVSender,
        KVClassType.RECEIVER: receiver.HybridKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: bootstrap.HybridKVBootstrapServer,
    }
    assert set(expected) == set(KVClassType)
    for kind, cls in expected.items():
        assert utils.get_kv_class(backend, kind) is cls


def test_our_classes_sit_on_the_common_layer():
    from sglang.srt.disaggregation.common.conn import (
        CommonKVBootstrapServer, CommonKVManager, CommonKVReceiver, CommonKVSender)

    backend = utils.TransferBackend("hybridkv")
    assert issubclass(utils.get_kv_class(backend, KVClassType.MANAGER), CommonKVManager)
    assert issubclass(utils.get_kv_class(backend, KVClassType.SENDER), CommonKVSender)
    assert issubclass(utils.get_kv_class(backend, KVClassType.RECEIVER), CommonKVReceiver)
    # A CommonKVBootstrapServer subclass is what the Rust server may stand in for.
    assert issubclass(utils.get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER), CommonKVBootstrapServer)


def test_builtin_backends_still_resolve():
    from sglang.srt.disaggregation.fake import FakeKVManager
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver

    tb = utils.TransferBackend
    assert utils.get_kv_class(tb("nixl"), KVClassType.MANAGER) is NixlKVManager
    assert utils.get_kv_class(tb("nixl"), KVClassType.RECEIVER) is NixlKVReceiver
    assert utils.get_kv_class(tb("fake"), KVClassType.MANAGER) is FakeKVManager


def test_disagg_service_sees_the_same_backend():
    # disagg_service imported get_kv_class by name; the hook must reach it too.
    from sglang.srt.managers import disagg_service

    assert disagg_service.get_kv_class is utils.get_kv_class
    assert disagg_service.rust_server_serves_kv_bootstrap("hybridkv") is True


def test_real_argparse_accepts_the_flag_and_rejects_unknown():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "dummy", "--disaggregation-mode", "prefill",
                            "--disaggregation-transfer-backend", "hybridkv"])
    assert ns.disaggregation_transfer_backend == "hybridkv"
    ns = parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "nixl"])
    assert ns.disaggregation_transfer_backend == "nixl"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "hybridkvx"])


def test_unknown_class_type_is_a_value_error():
    with pytest.raises(ValueError, match="KVClassType"):
        utils.get_kv_class(utils.TransferBackend("hybridkv"), "nope")
