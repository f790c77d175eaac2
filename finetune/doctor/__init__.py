"""`finetune doctor`: prove a machine in minutes, before paying for a long run (docs/doctor.md):
the environment (environment.py, devices.py), the links (main.py), the strategy runs (runs.py,
agreement.py); report.py writes the console text, doctor.json and doctor.html.
"""
