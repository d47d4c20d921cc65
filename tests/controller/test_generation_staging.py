"""A generation worker's side of the weight sync (issue 9): ``receive_weights`` (split) and
``stage_weights`` (colocated) only stage the new weights (the engine keeps sampling with its
own, so a call in flight is not touched); the next generation call switches to them and stamps
its groups with the new version; the engine then holds exactly the sender's weights, MTP heads
included. The split sender is a
thread of this process (gloo), standing in for train rank 0.

Guards: a sync that changes weights under a running call (a sample mixing two policies), and
one whose version stamp or weights do not reach the next call.
"""

import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from _tiny import TINY_STEP  # noqa: E402

from _configs import demo_config
from splitrl.dataplane import InProcessDataPlane  # noqa: E402
from splitrl.distributed.weight_sync import WeightSyncGroup, listen_socket, send_weights  # noqa: E402
from splitrl.models import PolicyModel  # noqa: E402
from splitrl.workers.generation import GenerationWorker  # noqa: E402

BUCKET = 256 * 1024


def test_receive_stages_and_the_next_call_switches(tmp_path):
    cfg = demo_config(TINY_STEP + [f"output_dir={tmp_path}", "cluster.backend=local"])
    gen = GenerationWorker(cfg.model, cfg.rollout, cfg.task, cfg.tokenizer, InProcessDataPlane(), device="cpu")
    src = PolicyModel.from_config(cfg.model)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.25 * torch.randn_like(p))
    layout = gen.weight_layout()
    sock, port = listen_socket("127.0.0.1")
    errors = []

    def train_rank_0():
        try:
            g = WeightSyncGroup("127.0.0.1", port, 0, 2, "cpu", listen_sock=sock, timeout_s=120)
            send_weights(g, layout, src, BUCKET)
            g.close()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    sender = threading.Thread(target=train_rank_0)
    sender.start()
    try:
        assert gen.join_weight_sync("127.0.0.1", port, 1, 2, layout, BUCKET, 120) == "gloo"
        before = {k: v.clone() for k, v in gen.engine.model.state_dict().items()}
        assert gen.receive_weights(5) == 5
    finally:
        sender.join(timeout=300)
    assert not errors, errors
    # staged only: the engine's weights and version are those of the call that may be running
    assert gen.engine.policy_version == 0 and gen.policy_version == 5
    for k, v in gen.engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    groups, _ = gen.generate_groups([0], 2)
    assert groups[0].policy_version == 5 and all(s.policy_version == 5 for s in groups[0].samples)
    want = src.state_dict()
    got = gen.engine.model.state_dict()
    assert any(k.startswith("mtp.") for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), k

    # the colocated path stages from a trainer model in this process the same way
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(0.5)
    before = {k: v.clone() for k, v in gen.engine.model.state_dict().items()}
    gen.stage_weights(src, 6, BUCKET)
    assert gen.engine.policy_version == 5 and gen.policy_version == 6
    for k, v in gen.engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    groups, _ = gen.generate_groups([1], 2)
    assert groups[0].policy_version == 6
    got = gen.engine.model.state_dict()
    for k, v in src.state_dict().items():
        assert torch.equal(got[k], v), k
    gen.close()
