"""`finetune doctor`: prove a machine in minutes, before paying for a long run (docs/doctor.md).

Three sections of report lines: the environment (environment.py, devices.py), the links between
GPUs (main.py), and a short run under every strategy, checked against one process (runs.py,
agreement.py). main.py ties them together; report.py writes the console text, doctor.json and
doctor.html.
"""
