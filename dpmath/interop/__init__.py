"""Adapters to peer accounting libraries, each behind its own extra.

* :mod:`dpmath.interop.dp_accounting` (``pip install "dp-randomized-clipping[dp-accounting]"``): a ``DpEvent`` for
  randomized clipping, exact conversions between our mechanisms and dp_accounting's events, and a
  dp_accounting ``PrivacyAccountant`` backed by :class:`dpmath.PLDAccountant`.
* The Opacus accountant lives in :mod:`dpsgd.opacus`, since Opacus imports torch and dpmath does not.

Nothing here is imported by ``import dpmath``.
"""
