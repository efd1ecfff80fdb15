"""ops/moe.py's grouped matmul under `jax.vmap` with the expert weights shared (a decode step vmapped over branches):
the batches' rows merge into one sorted by group, so each expert's weights are read once for all of them (no copy of
the weights per batch), with the values and gradients of one grouped matmul per batch."""
import jax
import jax.numpy as jnp
import numpy as np

from longstraw_jax.ops import moe

N, M, E, IN, OUT = 3, 7, 4, 5, 6


def _batches(key, n=N):
    """n batches of M rows sorted by group: sizes [n, E] with 0 to 2 rows of no group per batch."""
    rng = np.random.default_rng(key)
    sizes = np.zeros((n, E), np.int32)
    for b in range(n):
        used = M - rng.integers(0, 3)
        cuts = np.sort(rng.integers(0, used + 1, E - 1))
        sizes[b] = np.diff(np.concatenate([[0], cuts, [used]]))
    sizes[0, 1] = 0  # an empty group
    k = jax.random.split(jax.random.key(key), 2)
    return jax.random.normal(k[0], (n, M, IN)), jax.random.normal(k[1], (E, OUT, IN)), jnp.asarray(sizes)


def test_merged_rows_sort_every_batch_by_group():
    _, _, sizes = _batches(0)
    where, merged = moe.merged_rows(sizes, M)
    where, sizes, merged = np.asarray(where), np.asarray(sizes), np.asarray(merged)
    assert sorted(where.reshape(-1)) == list(range(N * M))  # a permutation
    np.testing.assert_array_equal(merged, sizes.sum(0))
    ends = np.cumsum(merged)
    for b in range(N):
        batch_ends = np.cumsum(sizes[b])
        for m in range(M):
            group = int(np.searchsorted(batch_ends, m, side="right"))
            if group < E:  # inside group `group`'s merged rows, after the earlier batches' rows of that group
                start = ends[group] - merged[group] + sizes[:b, group].sum()
                assert where[b, m] == start + m - (batch_ends[group] - sizes[b, group])
            else:  # rows of no group: after every group's, in batch order
                assert where[b, m] >= ends[-1]
    assert np.all(np.diff(where, axis=1) > 0)  # each batch's rows keep their order


def test_grouped_matmul_under_vmap_reads_the_shared_weights_once():
    lhs, rhs, sizes = _batches(1)
    probe = jax.random.normal(jax.random.key(2), (N, M, OUT))
    loss = lambda lhs, rhs, sizes, probe: jnp.sum(moe._grouped_ragged(lhs, rhs, sizes) * probe)
    one = jax.value_and_grad(loss, argnums=(0, 1))
    want = [one(lhs[b], rhs, sizes[b], probe[b]) for b in range(N)]
    batched = jax.jit(jax.vmap(one, in_axes=(0, None, 0, 0)))
    (value, (d_lhs, d_rhs)) = batched(lhs, rhs, sizes, probe)
    np.testing.assert_allclose(value, [w[0] for w in want], rtol=1e-5)
    np.testing.assert_allclose(d_lhs, np.stack([w[1][0] for w in want]), rtol=1e-5, atol=1e-5)
    # d rhs per batch (vmap keeps the batch axis of a per-batch gradient); rows of no group get 0
    np.testing.assert_allclose(d_rhs, np.stack([w[1][1] for w in want]), rtol=1e-5, atol=1e-5)
    out = jax.vmap(moe._grouped_ragged, in_axes=(0, None, 0))(lhs, rhs, sizes)
    for b in range(N):
        np.testing.assert_allclose(out[b], moe._grouped_ragged(lhs[b], rhs, sizes[b]), rtol=1e-5, atol=1e-5)
        assert float(jnp.abs(out[b, int(sizes[b].sum()):]).max(initial=0)) == 0  # rows of no group
    # the gradient of a loss over all batches: one d rhs, summed; and a vmap inside a vmap (groups x branches)
    total = lambda lhs, rhs: jnp.sum(jax.vmap(moe._grouped_ragged, in_axes=(0, None, 0))(lhs, rhs, sizes) * probe)
    d_total = jax.jit(jax.grad(total, argnums=1))(lhs, rhs)
    np.testing.assert_allclose(d_total, sum(w[1][1] for w in want), rtol=1e-5, atol=1e-5)
    outer = jnp.stack([lhs, lhs[::-1]])
    nested = jax.jit(jax.vmap(jax.vmap(moe._grouped_ragged, in_axes=(0, None, 0)), in_axes=(0, None, None)))
    got = nested(outer, rhs, sizes)
    np.testing.assert_allclose(got[0], out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1, 0], moe._grouped_ragged(lhs[-1], rhs, sizes[0]), rtol=1e-5, atol=1e-5)
    # no copy of the weights per batch in the program of the forward or of the rows' gradient (it was broadcast to
    # [N, E, OUT, IN] for ragged_dot's batching rule; XLA:CPU fuses it away, a GPU's grouped GEMM would read it)
    for program in (total, jax.grad(total, argnums=0)):
        assert f"{N}x{E}x{OUT}x{IN}x" not in jax.jit(program).lower(lhs, rhs).as_text()
    # and the GPU's program (the grouped matmul runs there; here it is lowered for CUDA on the CPU host)
    cuda = jax.jit(jax.grad(total, argnums=(0, 1))).trace(lhs, rhs).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" in cuda and f"{N}x{E}x{OUT}x{IN}x" not in jax.jit(total).trace(lhs, rhs).lower(
        lowering_platforms=("cuda",)).as_text()


def test_batched_weights_still_batch():
    """Weights batched too (each batch its own experts): one grouped matmul per batch, as before."""
    lhs, rhs, sizes = _batches(3)
    rhs = jnp.stack([rhs, 2 * rhs, -rhs])
    got = jax.jit(jax.vmap(moe._grouped_ragged))(lhs, rhs, sizes)
    for b in range(N):
        np.testing.assert_allclose(got[b], moe._grouped_ragged(lhs[b], rhs[b], sizes[b]), rtol=1e-5, atol=1e-5)
