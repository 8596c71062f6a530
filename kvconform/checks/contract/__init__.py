"""Family ``contract``: the contracts a cache keeps whatever its design, one module each.

* ``api``: the API surface callers rely on is there, and the bookkeeping it reports is true
  (``check_api_contract``, ``check_length_bookkeeping``, ``check_crop_refused``,
  ``check_encoder_decoder_subcaches``);
* ``evicting``: an evicting subject past its ``tokens_max`` (``check_evicting_bounds``, ``check_evicting_crop``,
  ``check_evicting_ops``);
* ``press``: a KV press (``check_press_contract``).

Importing the package registers every check of the family (``checks.load_checks``).
"""

from kvconform.checks.contract import api, evicting, press  # noqa: F401 - each registers its checks
