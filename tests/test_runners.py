"""The fast tier's end-to-end runs through FederatedScope, one per runner: fedavg's tiny YAML
through FS standalone and through FS distributed (a server and two client processes over gRPC)
gives the embedded runner's numbers and saved models. Skipped, with the reason, where FS is
not installed. The embedded runner's own is tests/test_every_method.py's fedavg case; every
other method through each runner is in the fs tier (tests/test_fs_integration.py)."""
from helpers import deep_update, requires_fs, tiny_config


@requires_fs
def test_fedavg_through_fs_standalone_matches_embedded(tmp_path):
    from test_fs_integration import test_fs_standalone_matches_embedded
    test_fs_standalone_matches_embedded(tmp_path, 'fedavg')


@requires_fs
def test_fedavg_through_fs_distributed_matches_embedded(tmp_path):
    from test_fs_integration import assert_distributed_matches_embedded
    base = tiny_config(tmp_path, 'fedavg', rounds=2, steps=3,
                       federate={'client_num': 2, 'sample_client_num': 2})
    deep_update(base, {'data': {'splitter': 'iid'}})
    rows = assert_distributed_matches_embedded(tmp_path, base)
    assert {row['client'] for row in rows if row['kind'] == 'eval'} == {1, 2}
