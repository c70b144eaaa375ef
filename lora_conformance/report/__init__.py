"""The certification report: execution records in, verdict and report files out.

- ``recorder.ReportRecorder``: the pytest plugin object that records outcomes and writes the report.
- ``verify.verify(records) -> Verdict``: pure; re-run on a stored report.json any time.
- ``document``: report.json (schema ``lora-conformance/report/1``) plus report.md/html and badge.svg.
- ``merge``: many reports -> one engine x device matrix.
"""
