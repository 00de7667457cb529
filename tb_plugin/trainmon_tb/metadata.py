"""Names shared by the loader, the plugin and the frontend."""

PLUGIN_NAME = "trainmon"
TAB_NAME = "trainmon"

# TensorBoard command-line flags the plugin adds (prefixed with the plugin name, as TensorBoard asks).
FLAG_ALLOW_DUMP_REQUESTS = "trainmon_allow_dump_requests"
FLAG_POLL_SECS = "trainmon_poll_secs"
DEFAULT_POLL_SECS = 5.0
