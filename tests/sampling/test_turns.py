"""Agent branches (sampling/turns.py, agents/environment.py) on a small Qwen3.6 and GLM-5.2 with O(1) weights.

- the log-probs recorded while sampling a multi-turn transcript equal a full forward's over prompt + transcript
  (`naive.response_logprobs`, what the replay scores) on the policy's tokens, and the observations in the
  transcript are exactly the environment's replies (mask 0);
- the padded slots of the observation extend change nothing: the same episodes with buckets of 1 (no padding) and
  of 32 give the same tokens and log-probs (left-padded prompts too);
- the observation is read: a different observation changes the later tokens' log-probs (under the same keys);
- a transcript replays without its environment (ScriptedEnvironment) to the same tokens; a turn that differs
  ends the branch with status "error";
- limits: max_turns, turn_len, max_observation (cut and counted), the response length (status "length");
- on a 2x4 mesh (groups over `data`, each sequence-parallel over `seq`): the one-device episodes (slow);
- faults: an environment that raises, times out or returns a malformed value ends only that branch ("error",
  the first error's text), the others go on; a factory that is not found or fails is one clear error;
- the calls where the environments live (`call_owned`: several processes, each its own; tests/trainer/test_agents.py
  runs two).
"""
import json
import time

import jax
import numpy as np
import pytest

from longstraw_jax import models
from longstraw_jax.agents import environment
from longstraw_jax.agents.environment import ScriptedEnvironment
from longstraw_jax.engine.naive import response_logprobs
from longstraw_jax.models.qwen36.config import FULL, LINEAR
from longstraw_jax.sampling.branches import SamplingConfig
from longstraw_jax.sampling.turns import TurnConfig, sample_episodes
from longstraw_jax.sharding.hosts import gather_objects
from tests.helpers import glm_o1_params, o1_params

P, G, R, V, STOP = 13, 3, 24, 64, 1


@pytest.fixture(scope="module", params=["qwen36", "glm52"])
def setup(request):
    if request.param == "qwen36":
        config = models.Qwen36Config.tiny(num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
                                          vocab_size=V, gdn_chunk_size=16)
        model = models.build(config)
        params = o1_params(model.init(jax.random.key(0)), jax.random.key(1))
    else:
        model = models.build(models.Glm52Config.tiny(vocab_size=V, index_topk=8))
        params = glm_o1_params(model, jax.random.key(1))
    prompts = np.random.default_rng(0).integers(2, V, (2, P)).astype(np.int32)
    return model, params, prompts


class Echo:
    """Answers each turn with `reply_len(turn)` tokens derived from the turn (or fixed ones), reward 1 per turn;
    done after `turns` turns."""

    def __init__(self, vocab_size, seed, turns=3, length=5, shift=0, fixed=None, delay=0.0, fail_at=None):
        self.turns, self.length, self.shift, self.fixed = turns, length, shift, fixed
        self.delay, self.fail_at = delay, fail_at
        self.vocab = vocab_size

    def reset(self, prompt_tokens, info, branch):
        self.k, self.branch = 0, branch

    def step(self, turn):
        self.k += 1
        if self.fail_at == (self.branch, self.k):
            raise KeyError("tool exploded")
        if self.delay and self.branch == 1:
            time.sleep(self.delay)
        if self.fixed is not None:
            return list(self.fixed), 1.0, self.k >= self.turns
        n = self.length + self.k + self.branch
        obs = (np.arange(n) * 7 + int(np.sum(turn)) + self.shift + self.branch) % (self.vocab - 2) + 2
        return obs.tolist(), 1.0, self.k >= self.turns


def run(model, params, prompts, envs, seed=0, left_pad=None, turns=None, sampling=None, **kw):
    sampling = sampling or SamplingConfig(response_len=R, stop_token=STOP, temperature=1.0)
    turns = turns or TurnConfig(max_turns=4, turn_len=4, **kw)
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(seed), b))(np.arange(len(prompts)))
    return sample_episodes(model, params, prompts, keys, G, sampling, turns, envs, chunk_size=8, left_pad=left_pad)


def envs_of(count, **kw):
    return [Echo(V, 0, **kw) for _ in range(count)]


def test_recorded_logprobs_equal_a_full_forward_and_observations_are_the_replies(setup):
    model, params, prompts = setup
    out = run(model, params, prompts, envs_of(2 * G))
    assert out.responses.shape == (2, G, R)
    for b in range(2):
        logp, _ = response_logprobs(model, params, prompts[b], out.responses[b])
        real = out.mask[b] == 1
        np.testing.assert_allclose(np.asarray(logp)[real], out.logprobs[b][real], atol=2e-4)
        for g in range(G):
            transcript = out.transcripts[b][g]
            assert transcript.status in ("done", "length", "max_turns")
            flat = np.concatenate([np.asarray(t["tokens"]) for t in transcript.turns]).astype(np.int32)
            n = len(flat)
            np.testing.assert_array_equal(out.responses[b, g, :n], flat)
            roles = np.concatenate([np.full(len(t["tokens"]), t["role"] == "assistant") for t in transcript.turns])
            np.testing.assert_array_equal(out.mask[b, g, :n] == 1, roles)
            assert np.all(out.mask[b, g, n:] == 0) and transcript.policy_turns >= 2
            assert out.rewards[b, g] == transcript.reward == sum(t["reward"] for t in transcript.turns
                                                                 if t["role"] == "tool")
    assert out.transcripts[0][0].observation_tokens > 0


def test_bucket_padding_changes_nothing(setup):
    model, params, prompts = setup
    padded = np.concatenate([np.full((2, 5), 9, np.int32), prompts], axis=1)
    left_pad = np.array([5, 5], np.int32)
    one = run(model, params, padded, envs_of(2 * G), left_pad=left_pad, min_bucket=1)
    wide = run(model, params, padded, envs_of(2 * G), left_pad=left_pad, min_bucket=32)
    np.testing.assert_array_equal(one.responses, wide.responses)
    np.testing.assert_array_equal(one.mask, wide.mask)
    np.testing.assert_allclose(one.logprobs, wide.logprobs, atol=1e-5)
    plain = run(model, params, prompts, envs_of(2 * G), min_bucket=32)  # the unpadded prompts: the same episodes
    np.testing.assert_array_equal(plain.responses, one.responses)
    np.testing.assert_allclose(plain.logprobs, one.logprobs, atol=2e-4)


def test_the_observation_is_read(setup):
    model, params, prompts = setup
    turns = TurnConfig(max_turns=2, turn_len=3)
    a = run(model, params, prompts, envs_of(2 * G, fixed=[5, 6, 7, 8]), turns=turns)
    b = run(model, params, prompts, envs_of(2 * G, fixed=[5, 6, 7, 9]), turns=turns)
    first = [len(t.turns[0]["tokens"]) for row in a.transcripts for t in row]
    # the first turns are the same draws; after the observation the log-probs differ
    np.testing.assert_array_equal(a.responses[..., :2], b.responses[..., :2])
    later = [(bb, g, first[bb * G + g] + 4) for bb in range(2) for g in range(G)]
    differ = [abs(a.logprobs[bb, g, j] - b.logprobs[bb, g, j]) > 1e-4 for bb, g, j in later
              if a.mask[bb, g, j] == 1 and a.responses[bb, g, j] == b.responses[bb, g, j]]
    assert differ and all(differ)


def test_a_transcript_replays_without_its_environment(setup):
    model, params, prompts = setup
    out = run(model, params, prompts, envs_of(2 * G))
    scripted = [ScriptedEnvironment(t.as_json()) for row in out.transcripts for t in row]
    again = run(model, params, prompts, scripted)
    np.testing.assert_array_equal(out.responses, again.responses)
    np.testing.assert_array_equal(out.rewards, again.rewards)
    other = run(model, params, prompts, [ScriptedEnvironment(t.as_json()) for row in out.transcripts for t in row],
                seed=5)  # other keys: the turns differ from the recorded ones
    statuses = {t.status for row in other.transcripts for t in row}
    assert "error" in statuses
    assert any("diverged" in (t.error or "") for row in other.transcripts for t in row)


def test_limits(setup):
    model, params, prompts = setup
    greedy = SamplingConfig(response_len=R, temperature=0.0)  # no stop token: every turn is turn_len long
    out = run(model, params, prompts, envs_of(2 * G, turns=99, length=30), sampling=greedy,
              turns=TurnConfig(max_turns=3, turn_len=2, max_observation=4))
    for row in out.transcripts:
        for t in row:
            lengths = [len(x["tokens"]) for x in t.turns]
            assert lengths[0::2] == [2, 2, 2] and lengths[1::2] == [4, 4, 0]  # the last reply is not appended
            assert t.status == "max_turns" and t.turns[1]["truncated"] > 0
    short = run(model, params, prompts, envs_of(2 * G, turns=99, length=30), sampling=greedy,
                turns=TurnConfig(max_turns=9, turn_len=2))
    for row in short.transcripts:
        for t in row:
            assert t.status == "length"
            assert sum(len(x["tokens"]) for x in t.turns) <= R


def test_faults_end_only_their_branch(setup):
    model, params, prompts = setup
    envs = envs_of(2 * G, fail_at=(2, 2), delay=3.0)  # branch 1 sleeps past the timeout; branch 2 raises in turn 2
    out = run(model, params, prompts, envs, timeout=0.5)
    for row in out.transcripts:
        assert row[0].status != "error"
        assert row[1].status == "error" and "timed out" in row[1].error
        assert row[2].status == "error" and "KeyError" in row[2].error and "turn 1" in row[2].error

    class Bad(Echo):
        def step(self, turn):
            return [V + 3], 1.0, False

    out = run(model, params, prompts, [Bad(V, 0) for _ in range(2 * G)])
    assert all(t.status == "error" and "out of range" in t.error for row in out.transcripts for t in row)


def test_factory_errors_are_one_line():
    with pytest.raises(environment.FactoryError, match="no attribute"):
        environment.make_environments("tests.sampling.test_turns:Nope", 2, V, 0)

    def broken(vocab_size, seed):
        raise OSError("no sandbox")

    with pytest.raises(environment.FactoryError, match="failed at start: OSError: no sandbox"):
        environment.make_environments(broken, 2, V, 0)
    with pytest.raises(environment.FactoryError, match="no reset / step"):
        environment.make_environments(lambda vocab_size, seed: object(), 1, V, 0)
    assert len(environment.make_environments(Echo, 3, V, 0, {"turns": 2})) == 3


def test_calls_where_the_environments_live():
    """call_owned: the calls of the slots whose environment is here run (a None slot lives on another process); a
    slot that no process holds is a clear error; a reply survives its exchange form (JSON) unchanged."""
    calls = {(0, 0): lambda: ([3, 4], 0.5, False), (0, 1): lambda: ([], None, True)}
    replies = environment.call_owned(calls, 5.0, lambda v: environment.check_step_result(v, V))
    assert replies[(0, 0)].observation.tolist() == [3, 4] and replies[(0, 1)].done
    with pytest.raises(ValueError, match=r"slot \(1, 2\): no process holds its environment"):
        environment.call_owned({**calls, (1, 2): None}, 5.0)
    framed = environment.check_step_result((environment.Framed([5], [6, 7], [8]), 1.0, False), V)
    again = environment.Reply.from_json(json.loads(json.dumps(framed.as_json())))
    assert again.observation.tolist() == [5, 6, 7, 8] and again.frame == (1, 2) and again.fit(3).tolist() == [5, 6, 8]
    assert again.observation.dtype == np.int32 and (again.reward, again.done, again.error) == (1.0, False, None)
    # one process: gather_objects is the value alone
    assert gather_objects({"a": [1, 2]}) == [{"a": [1, 2]}]


@pytest.mark.slow  # the sharded capture and decode compiled for both families
def test_episodes_on_a_mesh_equal_one_device(setup):
    """B = 2 groups on a 2x4 mesh (one group per data slice, each sequence-parallel over 4 devices): the same
    transcripts and, up to float round-off, log-probs as one device; the captures are the mesh sampler's."""
    from longstraw_jax import sharding
    from longstraw_jax.sampling.mesh import ShardedCaptured
    from longstraw_jax.sharding import rules

    model, params, prompts = setup
    mesh = sharding.make_mesh("2x4")
    placed = jax.device_put(params, rules.named(rules.param_specs(params, mesh), mesh))
    one = run(model, params, prompts, envs_of(2 * G))
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(0), b))(np.arange(2))
    sampling = SamplingConfig(response_len=R, stop_token=STOP, temperature=1.0)
    two = sample_episodes(model, placed, prompts, keys, G, sampling, TurnConfig(max_turns=4, turn_len=4),
                          envs_of(2 * G), chunk_size=8, mesh=mesh)
    np.testing.assert_array_equal(one.responses, two.responses)
    np.testing.assert_array_equal(one.mask, two.mask)
    np.testing.assert_allclose(one.logprobs, two.logprobs, atol=2e-4)
    assert isinstance(two.captured, ShardedCaptured)
    assert [t.status for row in one.transcripts for t in row] == [t.status for row in two.transcripts for t in row]
