"""Suite-wide settings."""

import os

# The order search caches its results on disk by default (~/.cache/pp_offload/orders): tests search
# afresh and leave nothing behind. Set before any test imports the search; child processes inherit it.
os.environ["PP_OFFLOAD_ORDER_CACHE"] = "off"
