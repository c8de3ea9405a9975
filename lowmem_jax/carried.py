"""The base of carried activations (:class:`lowmem_jax.quant.QTensor`,
:class:`lowmem_jax.sampling.SampledTensor`): an activation ``value`` travelling with the
form its readers keep for backward (a code, a sample of rows).

A carried activation passes through a user's model unchanged, from the op that makes it
(a norm under ``mesa8``, ``lowmem`` or ``wta-crs``) to the library's linears that read it
(``models.linear.Linear``, ``Mlp``, ``SelfAttention``). It tells its ``shape``, ``dtype``
and ``ndim``; read as an array by indexing, an operator, a method, ``jnp.asarray`` (so
``jax.numpy`` functions and Flax's layers) or ``np.asarray``, it raises an error that
names ``models.sites.as_array``, which gives the value (it failed deep inside jax with an
error about a type it does not know). A ``jax.lax`` primitive still gives jax's own error
(that ``__jax_array__`` cannot be used there).
"""

from __future__ import annotations

_OPERATORS = ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul",
              "rmatmul", "pow", "neg", "lt", "le", "gt", "ge")


class Carried:
  """Mixin of a carrier dataclass with a ``value`` field."""

  shape = property(lambda self: self.value.shape)
  dtype = property(lambda self: self.value.dtype)
  ndim = property(lambda self: self.value.ndim)

  def misread(self, what: str) -> TypeError:
    return TypeError(
        f"{what} of a {type(self).__name__}: this activation is carried with what the "
        "policy's next linear keeps for backward; pass it on to lowmem-jax modules, or read "
        "its value with models.sites.as_array(x)")

  def __getattr__(self, name):
    if name.startswith("_"):  # Python's protocols (copy, pickle) probe these
      raise AttributeError(name)
    raise AttributeError(str(self.misread(f".{name}")))

  def __getitem__(self, index):
    raise self.misread("indexing")

  def __array__(self, *args, **kwargs):
    raise self.misread("numpy.asarray")

  def __jax_array__(self):
    raise self.misread("jax.numpy.asarray")


def _refuse(op: str):
  def refuse(self, *args):
    raise self.misread(f"operator __{op}__")
  return refuse


for _op in _OPERATORS:
  setattr(Carried, f"__{_op}__", _refuse(_op))
