"""pallas_kernels/_lse.py: the log-sum-exp merge weights."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels import lse_merge_weights


def test_weights_are_the_softmax_share_of_each_part():
    lses = jnp.array([[0.0, np.log(3.0), -np.inf]])
    weights, lse = lse_merge_weights(lses, axis=1)
    np.testing.assert_allclose(weights, [[0.25, 0.75, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(lse, [np.log(4.0)], rtol=1e-6)


def test_all_parts_empty_gives_zero_weights_and_minus_inf():
    weights, lse = lse_merge_weights(jnp.full((2, 3), -jnp.inf), axis=0)
    assert np.all(np.asarray(weights) == 0) and np.all(np.isneginf(np.asarray(lse)))
