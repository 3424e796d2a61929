"""QuorumGroups, one rank's group of the current quorum: a group it left is never built
again on the same store prefix (its keys are spent: the peers' old addresses would make the
build hang), so that step fails at once and the next round names a new quorum."""

from __future__ import annotations

import torch
import torch.distributed as dist

from transom.ft.process_group import QuorumGroups


def test_a_group_left_here_is_not_built_again_on_its_prefix_and_a_new_one_is():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    addr = f"127.0.0.1:{store.port}"
    groups = QuorumGroups("gloo", 0, 5.0, torch.device("cpu"))
    assert groups.rebuild(addr, "job/0/q1", 0, 1, 1) is None and groups.group is not None
    assert not groups.changed("job/0/q1")
    groups.drop()  # aside, or a step that did not commit
    assert groups.group is None and groups.changed("job/0/q1")
    why = groups.rebuild(addr, "job/0/q1", 0, 1, 1)
    assert why is not None and "quorum 1" in why and groups.group is None
    assert groups.rebuild(addr, "job/0/q2", 0, 1, 2) is None and groups.group is not None
    t = torch.ones(2)
    for w in groups.group.allreduce_sum([t]):
        w.wait()
    assert t.tolist() == [1.0, 1.0]
    groups.drop()
