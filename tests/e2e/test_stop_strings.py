"""Stop strings cut a response after the token that completes one (DESIGN §5)."""

from splitrl.rollout.text import cut_at_stop_string


def test_cut_after_the_token_that_completes_the_stop_string():
    vocab = {1: "a", 2: "b", 3: "<", 4: "/", 5: "x", 6: ">"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    ids = [1, 2, 3, 4, 5, 6, 1, 2]  # "ab</x>ab"
    assert cut_at_stop_string(ids, decode, ["</x>"]) == 6
    assert cut_at_stop_string(ids, decode, ["b"]) == 2  # the first occurrence wins
    assert cut_at_stop_string(ids, decode, ["zz"]) is None
    assert cut_at_stop_string(ids, decode, []) is None


def test_generation_worker_ends_responses_at_stop_strings():
    from _configs import demo_config
    from splitrl.dataplane import InProcessDataPlane
    from splitrl.workers.generation import GenerationWorker

    cfg = demo_config(["rollout.max_new_tokens=8", "rollout.stop_strings=[',']"])
    dp = InProcessDataPlane()
    worker = GenerationWorker(cfg.model, cfg.rollout, cfg.task, cfg.tokenizer, dp, reward_timeout_s=10)
    try:
        groups, _ = worker.generate_groups(list(range(4)), 8)
    finally:
        worker.close()
    texts = [s.info["response"] for g in groups for s in g.samples]
    cut = [t for t in texts if "," in t]
    assert cut, "a random policy over 18 characters writes a comma within 8 most of the time"
    for t in cut:
        assert t.endswith(",") and t.count(",") == 1, t
    for g in groups:
        for smp in g.samples:
            ids = dp.get([smp.sample_id], ["input_ids", "generation_logprobs"])
            assert ids["input_ids"][0].numel() == smp.prompt_len + smp.response_len
            assert ids["generation_logprobs"][0].numel() == smp.prompt_len + smp.response_len


def test_generation_worker_hands_each_group_over_when_its_last_sample_ends():
    """Groups are scored and stored as they complete (continuous batching), before the call ends."""
    import pytest

    from _configs import demo_config
    from splitrl.dataplane import InProcessDataPlane
    from splitrl.workers.generation import GenerationWorker

    cfg = demo_config(["rollout.max_new_tokens=6", "rollout.batch_size=4"])
    dp = InProcessDataPlane()
    worker = GenerationWorker(cfg.model, cfg.rollout, cfg.task, cfg.tokenizer, dp, reward_timeout_s=10)
    seen = []

    def on_group(group):
        seen.append(group)
        assert len(group.samples) == 4
        dp.get([s.sample_id for s in group.samples], ["input_ids"])  # already stored
        if len(seen) == 1:  # the last group is still being generated: nothing of it is stored
            with pytest.raises(KeyError):
                dp.get(["p2-s3-v0"], ["input_ids"])

    try:
        groups, _ = worker.generate_groups([0, 1, 2], 4, on_group=on_group)
    finally:
        worker.close()
    assert [g.prompt_index for g in groups] == [0, 1, 2]
    assert sorted(g.prompt_index for g in seen) == [0, 1, 2]
