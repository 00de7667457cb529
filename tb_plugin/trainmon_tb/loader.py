"""Entry point of the plugin: defines its flags and imports the plugin only inside :meth:`load`, so that a
missing or broken dependency logs an error and leaves TensorBoard running without this tab."""

from __future__ import annotations

import logging

from tensorboard.plugins import base_plugin

from trainmon_tb import metadata

logger = logging.getLogger("trainmon")


class TrainmonLoader(base_plugin.TBLoader):
    def define_flags(self, parser) -> None:
        group = parser.add_argument_group("trainmon plugin")
        group.add_argument(
            f"--{metadata.FLAG_ALLOW_DUMP_REQUESTS}",
            action="store_true",
            default=False,
            help="let the trainmon tab ask running jobs for tensor dumps (writes requests.jsonl in run "
            "directories). Off by default: TensorBoard has no authentication.",
        )
        group.add_argument(
            f"--{metadata.FLAG_POLL_SECS}",
            type=float,
            default=metadata.DEFAULT_POLL_SECS,
            help="how often the trainmon tab looks for new runs and records, in seconds (default 5)",
        )

    def fix_flags(self, flags) -> None:
        secs = getattr(flags, metadata.FLAG_POLL_SECS, metadata.DEFAULT_POLL_SECS)
        if secs is not None and secs <= 0:
            raise base_plugin.FlagsError(f"--{metadata.FLAG_POLL_SECS} must be > 0, got {secs}")

    def load(self, context):
        try:
            from trainmon_tb.plugin import TrainmonPlugin

            return TrainmonPlugin(context)
        except Exception:  # never take TensorBoard down for this tab
            logger.exception("trainmon: the TensorBoard plugin could not be loaded; the tab is disabled")
            return None
