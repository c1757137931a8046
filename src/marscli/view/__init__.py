"""Views for people: trajectories in the terminal, the live trace, run folders reduced to numbers,
curves and the HTML report.
"""
