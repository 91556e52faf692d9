"""The tree mechanism (Kornowski, Liu & Talwar, Alg. 1; lit_zodp/privacy/tree.py). Review 58: the O2NC tests said the
tree was tested here, but this file did not exist."""

import copy
import pickle

import pytest
import torch

from lit_zodp.privacy.noise import NoiseSource
from lit_zodp.privacy.tree import TreeAggregator, dyadic_nodes, releases_per_leaf

pytestmark = pytest.mark.filterwarnings("ignore:`noise_seed`")


@pytest.mark.parametrize("position", range(1, 70))
def test_node_p_is_a_disjoint_dyadic_cover_of_1_to_p(position):
    nodes = dyadic_nodes(position)
    assert len(nodes) == bin(position).count("1")
    covered = [leaf for first, last in nodes for leaf in range(first, last + 1)]
    assert covered == list(range(1, position + 1))
    for first, last in nodes:
        size = last - first + 1
        assert size & (size - 1) == 0 and (first - 1) % size == 0  # a node of the dyadic tree


@pytest.mark.parametrize("period", list(range(1, 70)) + [127, 128, 129, 1000])
def test_releases_per_leaf_is_the_most_released_nodes_holding_one_leaf(period):
    released = {node for p in range(1, period + 1) for node in dyadic_nodes(p)}
    most = max(sum(first <= leaf <= last for first, last in released) for leaf in range(1, period + 1))
    assert releases_per_leaf(period) == most


def test_a_node_has_one_noise_vector_reused_by_every_prefix_that_holds_it():
    """With zero increments each release is TREE(p): the sum of its nodes' vectors, each drawn once per period."""
    tree, noise, std, dim = TreeAggregator(8), NoiseSource(3), 0.5, 64
    releases = [tree.push(torch.zeros(dim), std, noise) for _ in range(8)]
    vectors = {node: key.add_scaled_(torch.zeros(dim, dtype=torch.float64), std, 0)
               for node, key in tree._node_noise.items()}
    assert sorted(vectors) == [(1, 1), (1, 2), (1, 4), (1, 8), (3, 3), (5, 5), (5, 6), (7, 7)]  # the released nodes
    for p, release in enumerate(releases, start=1):
        torch.testing.assert_close(release, sum(vectors[node] for node in dyadic_nodes(p)), rtol=0, atol=0)
    keys = [tuple(int(k) for k in key.key) for key in tree._node_noise.values()]
    assert len(set(keys)) == len(keys)
    # a new period: fresh keys (none of the last period's), and the running sum restarts
    first = tree.push(torch.ones(dim), std, noise)
    assert tree.position == 1 and len(tree._node_noise) == 1
    assert tuple(int(k) for k in tree._node_noise[(1, 1)].key) not in keys
    assert abs(float((first - 1.0).std()) - std) < 0.25


def test_tree_p_has_popcount_p_node_variances():
    tree, noise, std, dim = TreeAggregator(16), NoiseSource(4), 2.0, 20000
    for p in range(1, 17):
        release = tree.push(torch.zeros(dim), std, noise)
        assert float(release.var()) == pytest.approx(bin(p).count("1") * std**2, rel=0.06)


def test_the_running_sum_is_exact_without_noise_and_restarts_each_period():
    tree = TreeAggregator(3)
    out = [float(tree.push(torch.tensor([float(v)]), 0.0, None)) for v in (1, 2, 3, 4, 5, 6, 7)]
    assert out == [1, 3, 6, 4, 9, 15, 7]


def test_a_copy_or_a_pickle_holds_no_secret_and_starts_a_period():
    tree, noise = TreeAggregator(4), NoiseSource(5)
    tree.push(torch.full((3,), 123.0), 1.0, noise)
    tree.push(torch.full((3,), 456.0), 1.0, noise)
    blob = pickle.dumps(tree)
    for key in tree._node_noise.values():
        for word in key.key:
            assert int(word).to_bytes(8, "little") not in blob
    for other in (pickle.loads(blob), copy.deepcopy(tree)):
        assert other.period == 4 and other.position == 0 and other._total is None and other._node_noise == {}
    with pytest.raises(RuntimeError, match="secret noise source"):
        TreeAggregator(2).push(torch.zeros(2), 1.0, None)
