"""A model's scalar loss as a function of its parameters, for gradient and residual tests."""

import jax
from flax import nnx

from lowmem_jax.memory import saved_residuals


def param_loss(reduce, model, inputs):
  """``(loss(params), params)``: ``reduce(model(inputs))`` with the other state fixed."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    return reduce(nnx.merge(graphdef, p, rest, copy=True)(inputs))
  return loss, params


def loss_and_grads(reduce, model, inputs):
  loss, params = param_loss(reduce, model, inputs)
  return jax.jit(jax.value_and_grad(loss))(params)


def saved_bytes(reduce, model, inputs):
  return saved_residuals(*param_loss(reduce, model, inputs)).total_bytes
