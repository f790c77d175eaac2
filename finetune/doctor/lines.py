"""One line of the doctor's report: what was checked, what was found, and for a problem its fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK, PROBLEM, SKIPPED = "ok", "problem", "skipped"


@dataclass
class Line:
    section: str  # environment | links | strategies
    name: str  # what was checked ("torch", "GPU 0", "zero2 losses", ...)
    status: str  # ok | problem | skipped
    detail: str  # what was found; for skipped, why
    fix: str | None = None  # one line, for a problem
    data: dict = field(default_factory=dict)  # the figures behind the line (doctor.json)

    def __post_init__(self):
        if self.status not in (OK, PROBLEM, SKIPPED):
            raise ValueError(f"status {self.status!r}: allowed ok, problem, skipped")
        if self.status == PROBLEM and not self.fix:
            raise ValueError(f"problem line {self.name!r} has no fix")

    def to_dict(self) -> dict:
        return asdict(self)


def ok(section: str, name: str, detail: str, /, **data) -> Line:
    return Line(section, name, OK, detail, data=data)


def problem(section: str, name: str, detail: str, fix: str, /, **data) -> Line:
    return Line(section, name, PROBLEM, detail, fix, data=data)


def skipped(section: str, name: str, why: str, /, **data) -> Line:
    return Line(section, name, SKIPPED, why, data=data)


def problems(lines: list[Line]) -> list[Line]:
    return [line for line in lines if line.status == PROBLEM]
