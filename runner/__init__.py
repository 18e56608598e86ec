"""Running a flow from the command line and watching it: the harness around every flow.

The temporary Prefect server (`prefect_server.process`) and the local Ray beside it (`runtime`), stop
signals and the bounded wait for a lost API (`stopping`), the failure hook and webhook (`hooks`),
and what the terminal shows (`console`). The flows (``flows/``) hold their stage lists and use this.
"""
