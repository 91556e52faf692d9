"""The tree mechanism (Kornowski, Liu & Talwar, Alg. 1 / Prop. 2.5), checked against independent references.

Privacy-critical: each check here is written so that a wrong mechanism fails it (a node dropped, a node's noise
re-keyed at every step, one level too few declared, no noise at a period's last step, keys kept across periods
or in a copy, the wrong std or divisor, the tree counted per step in the ledger).
"""

import copy
import itertools
import math
import pickle

import numpy as np
import pytest
import torch

from lit_zodp.errors import AccountingError
from lit_zodp.privacy import (
    GaussianRelease,
    NoiseSource,
    NonPrivate,
    PrivacyComponent,
    PrivacyLedger,
    SinglePassSampling,
    TreeAggregator,
    releases_per_leaf,
)
from lit_zodp.privacy.mechanisms import Gaussian, SinglePassGaussian
from lit_zodp.privacy.tree import dyadic_nodes

pytestmark = pytest.mark.filterwarnings("ignore:`noise_seed` is set")


# ------------------------------------------------------------------------------------------------ references
def reference_nodes(position: int) -> set:
    """NODE(p) by a greedy walk from the left: the largest aligned power-of-2 block that fits, repeatedly."""
    nodes, start = set(), 1
    while start <= position:
        size = 1
        while (start - 1) % (2 * size) == 0 and start + 2 * size - 1 <= position:
            size *= 2
        nodes.add((start, start + size - 1))
        start += size
    return nodes


def brute_force_releases_per_leaf(period: int) -> int:
    """Max over leaves of the number of DISTINCT released nodes (union over p = 1..period of NODE(p)) holding it."""
    released = set().union(*(set(dyadic_nodes(p)) for p in range(1, period + 1)))
    return max(sum(first <= leaf <= last for first, last in released) for leaf in range(1, period + 1))


def tree_noises(period: int, std: float, source, dim: int, pushes: int = None) -> list:
    """The noise of each release (released minus the exact prefix sum) of a tree fed random increments."""
    tree, generator, total, noises = TreeAggregator(period), torch.Generator().manual_seed(period), None, []
    for _ in range(period if pushes is None else pushes):
        if tree.period_done:
            total = torch.zeros(dim, dtype=torch.float64)
        increment = torch.randn(dim, generator=generator, dtype=torch.float64)
        total = total + increment
        noises.append(tree.push(increment, std, source) - total)
    return noises


# ------------------------------------------------------------------------------------------ 1. dyadic_nodes
def test_dyadic_nodes_are_disjoint_aligned_dyadic_intervals_covering_exactly_one_to_p():
    for p in range(1, 301):
        nodes = dyadic_nodes(p)
        assert len(nodes) == bin(p).count("1"), p
        leaves = []
        for first, last in nodes:
            length = last - first + 1
            assert length > 0 and length & (length - 1) == 0, (p, first, last)  # a power of 2
            assert (first - 1) % length == 0, (p, first, last)  # aligned: a node of the dyadic tree
            leaves.extend(range(first, last + 1))
        assert sorted(leaves) == list(range(1, p + 1)), p  # disjoint (no repeats) and exactly [1, p]
        assert set(nodes) == reference_nodes(p), p


@pytest.mark.parametrize("position", [0, -1, -8])
def test_dyadic_nodes_refuse_a_position_below_one(position):
    with pytest.raises(ValueError, match="1-based"):
        dyadic_nodes(position)


# -------------------------------------------------------------------------------------- 2. releases_per_leaf
def test_releases_per_leaf_is_the_brute_force_count_of_distinct_released_nodes_holding_a_leaf():
    for period in range(1, 301):
        assert releases_per_leaf(period) == brute_force_releases_per_leaf(period), period
    assert [releases_per_leaf(s) for s in (1, 2, 3, 4, 7, 8, 16, 17)] == [1, 2, 2, 3, 3, 4, 5, 5]


@pytest.mark.parametrize("period", [0, -3])
def test_releases_per_leaf_refuses_a_non_positive_period(period):
    with pytest.raises(ValueError, match="tree period"):
        releases_per_leaf(period)
    with pytest.raises(ValueError, match="tree period"):
        TreeAggregator(period)


# ------------------------------------------------------------------------------------- 3. exact prefix sums
@pytest.mark.parametrize("period", [1, 5, 8])
def test_without_noise_the_tree_releases_the_exact_running_sums_period_by_period(period):
    tree = TreeAggregator(period)
    increments = [torch.tensor([float(i), -2.0 * i, 0.5]) for i in range(1, 3 * period + 2)]
    assert tree.period_done and tree.position == 0
    for step, increment in enumerate(increments):
        start = step - step % period
        released = tree.push(increment, 0.0, None)  # std 0: needs no noise source
        assert released.dtype == torch.float64
        assert torch.equal(released, torch.stack(increments[start:step + 1]).double().sum(0)), step
        assert tree.position == step % period + 1
        assert tree.period_done == (tree.position == period)
    tree.push(torch.ones(3), 0.0, None)  # mid-period (or at a period's first step when period is 1)
    tree.reset()
    assert tree.position == 0 and tree.period_done
    assert torch.equal(tree.push(torch.full((3,), 7.0), 0.0, None), torch.full((3,), 7.0, dtype=torch.float64))


def test_a_release_does_not_alias_the_running_sum():
    tree = TreeAggregator(4)
    first = tree.push(torch.ones(2), 0.0, None)
    first.add_(100.0)  # a caller writing into its release must not move the period's sum
    assert torch.equal(tree.push(torch.ones(2), 0.0, None), torch.full((2,), 2.0, dtype=torch.float64))


def test_a_noisy_release_without_a_noise_source_is_refused():
    with pytest.raises(RuntimeError, match="secret noise source"):
        TreeAggregator(4).push(torch.zeros(2), 1.0, None)


# --------------------------------------------------------------------------- 4. the node noise, exactly
def _node_vectors(seed: int, count: int, dim: int) -> np.ndarray:
    """The first ``count`` vectors the source keyed by ``seed`` can key (``vector_key``), as rows."""
    source, rows = NoiseSource(seed), []
    for _ in range(count):
        row = torch.zeros(dim, dtype=torch.float64)
        source.vector_key().add_scaled_(row, 1.0, 0)
        rows.append(row.numpy())
    return np.stack(rows)


@pytest.mark.parametrize("period", [6, 8, 13])
def test_each_release_adds_the_noise_of_exactly_its_nodes_each_node_keyed_once(period):
    """Every release's noise is a 0/1 combination of the source's first ``period`` keyed vectors (one new node per
    position: a period releases exactly ``period`` distinct nodes), and the combination is NODE(p): node by node,
    the same vector at every position that uses it, a different one for each node, at std ``std``."""
    dim, std, seed = 64, 0.75, 11
    noises = tree_noises(period, std, NoiseSource(seed), dim)
    basis = _node_vectors(seed, 2 * period, dim)  # (room for a mechanism keying more than it should)
    coefficients, *_ = np.linalg.lstsq(basis.T, np.stack([n.numpy() for n in noises]).T / std, rcond=None)
    coefficients = coefficients.T  # position x key
    rounded = np.round(coefficients)
    np.testing.assert_allclose(coefficients, rounded, atol=1e-9)  # exactly a combination of keyed vectors...
    assert set(np.unique(rounded)) <= {0.0, 1.0}  # ... each at most once, at std exactly
    assert not rounded[:, period:].any()  # period releases key period nodes, no more
    used = [frozenset(np.flatnonzero(row)) for row in rounded]
    node_key = {}
    for p in range(1, period + 1):
        expected = reference_nodes(p)
        assert len(used[p - 1]) == len(expected), p  # popcount(p) nodes, none dropped (position = period too)
        new = [node for node in expected if node not in node_key]
        assert len(new) == 1 and new[0][1] == p, p  # the one new node of position p is the one ending at p
        previous = set().union(*(node_key.values())) if node_key else set()
        (key,) = used[p - 1] - previous  # and it has a key never used before...
        node_key[new[0]] = {key}
        assert used[p - 1] == frozenset().union(*(node_key[node] for node in expected)), p  # ... old nodes, old keys


def test_releases_share_node_noise_where_they_share_nodes():
    """By differencing releases: position 3's noise minus position 2's is node (3,3)'s, positions 4..7 all hold node
    (1,4)'s noise, and position = period is noised (8 of 8: node (1,8); 6 of 6: nodes (1,4) and (5,6)). Within a
    period each position keys exactly one new node, the one ending there, so node ``(first, p)`` is the source's
    ``p``-th keyed vector: the reference below."""
    dim, std, seed = 32, 0.5, 3
    vectors = torch.from_numpy(_node_vectors(seed, 8, dim)) * std

    def node(first, last):
        return vectors[last - 1]

    for period in (6, 8):
        noise = [None] + tree_noises(period, std, NoiseSource(seed), dim)  # noise[p]: position p

        def close(a, b):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

        close(noise[1], node(1, 1))
        close(noise[2], node(1, 2))
        close(noise[3] - noise[2], node(3, 3))
        close(noise[4], node(1, 4))
        close(noise[5] - node(1, 4), node(5, 5))
        close(noise[6] - node(1, 4), node(5, 6))
        for p in range(4, period + 1):
            if p < 8:  # positions 4..7 share node (1,4)
                others = [node(*n) for n in reference_nodes(p) if n != (1, 4)]
                close(noise[p] - node(1, 4), sum(others, torch.zeros(dim, dtype=torch.float64)))
        if period == 8:
            close(noise[7], node(1, 4) + node(5, 6) + node(7, 7))
            close(noise[8], node(1, 8))  # the period's last release: its own node over the whole period
        assert noise[period].norm() > 1.0  # noised: (32 coordinates of std >= 0.5)


def test_a_new_period_keys_new_nodes():
    """Node (1,1) of the second period is not the first period's: a re-used key would release the difference of two
    prefix sums without noise."""
    period, dim = 4, 16
    noises = tree_noises(period, 1.0, NoiseSource(5), dim, pushes=2 * period)
    basis = _node_vectors(5, 3 * period, dim)
    first_period_vectors = torch.from_numpy(basis[:period])
    for second in noises[period:]:
        for vector in first_period_vectors:
            assert not torch.allclose(second, vector) and not torch.allclose(second, noises[0])
    assert torch.allclose(noises[period], torch.from_numpy(basis[period]), atol=1e-12)  # the next key, fresh


# ------------------------------------------------------------------------------------ 5. the noise's law
def test_release_noise_has_mean_zero_variance_popcount_and_covariance_of_shared_nodes():
    """Over 40 sources x 2500 coordinates (fixed test seeds: deterministic), per period of 8: mean 0, variance
    popcount(p) std^2, covariance (shared nodes) std^2. Tolerances are 6 standard errors of each estimate."""
    period, std, dim, sources = 8, 1.5, 2500, 40
    samples = torch.stack([torch.stack(tree_noises(period, std, NoiseSource(1000 + s), dim))
                           for s in range(sources)])  # source x position x coordinate
    flat = samples.permute(1, 0, 2).reshape(period, -1)  # position x sample
    count = flat.shape[1]
    covariance = flat @ flat.T / count
    for p, q in itertools.product(range(1, period + 1), repeat=2):
        shared = len(reference_nodes(p) & reference_nodes(q))
        expected = shared * std ** 2
        var_p, var_q = bin(p).count("1") * std ** 2, bin(q).count("1") * std ** 2
        error = math.sqrt((var_p * var_q + expected ** 2) / count)
        assert abs(covariance[p - 1, q - 1].item() - expected) < 6 * error, (p, q, covariance[p - 1, q - 1], expected)
    means = flat.mean(1)
    for p in range(1, period + 1):
        assert abs(means[p - 1].item()) < 6 * std * math.sqrt(bin(p).count("1") / count), p


# ---------------------------------------------------------------------------------------------- 6. secrets
@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda tree: pickle.loads(pickle.dumps(tree))])
def test_a_copy_of_a_tree_mid_period_holds_no_sum_and_no_keys(duplicate):
    tree = TreeAggregator(8)
    source = NoiseSource(9)
    for _ in range(3):
        tree.push(torch.full((4,), 3.0), 1.0, source)
    assert tree.position == 3 and tree._node_noise and tree._total is not None
    copied = duplicate(tree)
    assert copied.period == 8 and copied.position == 0 and copied.period_done
    assert copied._total is None and copied._node_noise == {}
    assert torch.equal(copied.push(torch.ones(4), 0.0, None), torch.ones(4, dtype=torch.float64))  # no old sum
    state = pickle.dumps(tree)
    assert b"_node_noise" not in state and b"_total" not in state and len(state) < 200
    assert tree.position == 3 and len(tree._node_noise) == 3  # the original keeps its period: (1,1), (1,2), (3,3)


def test_ranks_sharing_a_secret_release_the_same_tree_and_fresh_secrets_differ():
    secret = 0x5EC2E7_0000_0000_0000_0000_0000_0001
    rank_0 = tree_noises(8, 1.0, NoiseSource.from_secret(secret), 16, pushes=12)
    rank_1 = tree_noises(8, 1.0, NoiseSource.from_secret(secret), 16, pushes=12)
    assert all(torch.equal(a, b) for a, b in zip(rank_0, rank_1))
    fresh_a = tree_noises(8, 1.0, NoiseSource(), 16)
    fresh_b = tree_noises(8, 1.0, NoiseSource(), 16)
    assert all(not torch.allclose(a, b) for a, b in zip(fresh_a, fresh_b))
    assert all(not torch.allclose(a, b) for a, b in zip(fresh_a, rank_0))


# ------------------------------------------------------------------------- 7. the component's release_prefix
PERIOD, RATIO, SIGMA, CLIP, N, STEPS = 8, 1.5, 2.0, 0.5, 1000, 50  # B = N / STEPS = 20
COUNT = 4  # releases_per_leaf(8): leaf 1 lies in (1,1), (1,2), (1,4), (1,8)


def o2nc_like_plan(period=PERIOD, ratio=RATIO):
    return (GaussianRelease("estimate", sensitivity=math.sqrt(releases_per_leaf(period)) * ratio, noise=ratio),)


def planned_single_pass(**kwargs):
    component = PrivacyComponent(**({"clip": CLIP, "noise_multiplier": SIGMA, "delta": 1e-5,
                                     "neighbours": "replace_one"} | kwargs))
    component.plan(step_plan=o2nc_like_plan(), sampling=SinglePassSampling(n=N, steps=STEPS), planned_steps=STEPS)
    return component


def test_dpo2nc_declares_the_tree_with_the_releases_per_leaf_of_its_period():
    from lit_zodp.algorithms.o2nc import DPO2NC, ESTIMATE

    module = DPO2NC(torch.nn.Linear(3, 1), period=PERIOD, clip=CLIP, difference_clip=CLIP * RATIO,
                    noise_multiplier=SIGMA)
    assert module.step_plan() == (GaussianRelease(ESTIMATE, sensitivity=math.sqrt(COUNT) * RATIO, noise=RATIO),)


def test_release_prefix_adds_node_noise_of_noise_two_sigma_clip_over_the_expected_batch_size():
    component = planned_single_pass(noise_seed=7)
    B = N / STEPS
    tree, reference_tree, reference = TreeAggregator(PERIOD), TreeAggregator(PERIOD), NoiseSource(7)
    node_std = RATIO * 2 * SIGMA * CLIP / B  # replace-one neighbours double the std; then divided by B
    generator = torch.Generator().manual_seed(0)
    for step in range(2 * PERIOD + 3):
        increment = torch.randn(5, generator=generator)
        released = component.release_prefix(increment, "estimate", tree, batch_size=13)  # realized size: ignored
        expected = reference_tree.push(increment.double() / B, node_std, reference)
        assert released.dtype == torch.float64
        torch.testing.assert_close(released, expected, rtol=0, atol=1e-15)
        component.commit_step()
    # and the noise is there: at std node_std (not 0, not the undivided sigma C)
    zero_tree = TreeAggregator(PERIOD)
    noise = component.release_prefix(torch.zeros(4000), "estimate", zero_tree)  # position 1: one node
    assert noise.std().item() == pytest.approx(node_std, rel=0.05)


def test_the_tree_is_accounted_once_as_one_gaussian_of_mu_sqrt_count_over_sigma():
    component = planned_single_pass()
    tree = TreeAggregator(PERIOD)
    component.release_prefix(torch.zeros(3), "estimate", tree)
    component.commit_step()
    ((mechanism, steps),) = component.ledger.counts.items()
    assert isinstance(mechanism, SinglePassGaussian) and steps == 1
    assert mechanism.noise_multiplier == pytest.approx(SIGMA / math.sqrt(COUNT), rel=1e-12)
    after_one = component.epsilon()
    for _ in range(3 * PERIOD - 1):
        component.release_prefix(torch.zeros(3), "estimate", tree)
        component.commit_step()
    assert component.ledger.counts == {mechanism: 3 * PERIOD}
    assert component.epsilon() == after_one  # counted once, however many steps
    one_gaussian = PrivacyLedger()
    one_gaussian.record(Gaussian(SIGMA / math.sqrt(COUNT)), 1)
    assert after_one == pytest.approx(one_gaussian.epsilon(1e-5).upper, rel=1e-9)
    # and against the exact epsilon(delta) of a Gaussian mechanism (Balle & Wang): the bound is above it, and within
    # twice the accountant's eps_error (0.05: the upper bound is within it of the PRV estimate, itself a little above
    # the exact value): COUNT - 1 levels would give 3.7, COUNT + 1 levels 5.0
    mu = math.sqrt(COUNT) / SIGMA
    exact = _gaussian_epsilon(mu, 1e-5)
    assert exact <= after_one <= exact + 2 * 0.05


def _gaussian_epsilon(mu: float, delta: float) -> float:
    def cdf(x):
        return 0.5 * math.erfc(-x / math.sqrt(2))

    def delta_of(eps):
        return cdf(-eps / mu + mu / 2) - math.exp(eps) * cdf(-eps / mu - mu / 2)

    low, high = 0.0, 100.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_of(middle) > delta else (low, middle)
    return high


def test_release_prefix_under_a_name_outside_the_plan_is_refused():
    component = planned_single_pass()
    with pytest.raises(AccountingError, match="not in the step plan"):
        component.release_prefix(torch.zeros(3), "gradient", TreeAggregator(PERIOD))


def test_the_non_private_twin_releases_the_running_sum_of_means_over_the_realized_batches():
    twin = NonPrivate(clip=math.inf)
    twin.plan(step_plan=o2nc_like_plan())
    tree = TreeAggregator(3)
    sizes = [4, 2, 5, 1, 8]
    increments = [torch.tensor([float(i), 1.0]) for i in range(1, 6)]
    expected_sums = []
    for step, (increment, size) in enumerate(zip(increments, sizes)):
        start = step - step % 3
        expected_sums.append(sum(increments[j].double() / sizes[j] for j in range(start, step + 1)))
        released = twin.release_prefix(increment, "estimate", tree, batch_size=size)
        assert released.dtype == torch.float64
        torch.testing.assert_close(released, expected_sums[-1], rtol=1e-15, atol=0)
