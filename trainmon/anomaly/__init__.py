"""Anomaly detection: the rules' engine, where a NaN started, the anomaly records (the columnar anomaly
table and the steps table, written through ``trainmon.run``) and alert delivery."""
