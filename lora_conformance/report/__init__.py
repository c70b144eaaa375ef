"""The certification report: execution records in, verdict and report files out.

- ``recorder.ReportRecorder``: the pytest plugin object that records outcomes and writes the report.
- ``judge.verdict.verify(records) -> Verdict``: pure; re-run on a stored report.json any time.
- ``document``: report.json (schema ``lora-conformance/report/2``, digest over everything: ``canonical_bytes``)
  plus report.md/html and badge.svg; ``legacy`` reads schema 1.
- ``selection``: what a run selected and whether it ran every feature (partial runs).
- ``merge``: many reports -> one engine x device matrix.
"""
