"""What reads a finished (or running) run or sweep and draws or tabulates it, one command each:

python -m reports.run_report RUN_DIR       # phase_change.png, composition.png, validity, summary.json
python -m reports.pair_curves RUN_DIR      # every L0->L1 pair's raw K-composition (aslvrstn 2022's plot)
python -m reports.sweep_report SWEEP_DIR   # two tables and three figures for a sweep
"""
