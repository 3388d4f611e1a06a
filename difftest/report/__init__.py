from difftest.report.build import SCHEMA_VERSION, build_report, validate_report, write_reports

__all__ = ["SCHEMA_VERSION", "build_report", "validate_report", "write_reports"]
