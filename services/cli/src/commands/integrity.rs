//! `provledger integrity acknowledge KIND/ID --lost N[-M] --reason TEXT`: an operator's
//! acknowledgement, in the log, that versions of an aggregate are lost from it
//! (`provledger_events::loss`), so that the aggregate is read and written again.

use provledger_client::Ledger;
use provledger_events::ids::InvalidText;
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, HistoryEntry, LostVersions,
};

use super::{print_json, CommandError};

/// The versions an operator names: `N` or `N-M`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LostRange {
    pub from_version: u64,
    pub to_version: u64,
}

impl std::str::FromStr for LostRange {
    type Err = InvalidText;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| InvalidText {
            what: "a version or a range of versions (2, 2-5)",
            text: s.to_string(),
            reason: reason.to_string(),
        };
        let version = |t: &str| {
            t.trim()
                .parse::<u64>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| invalid(&format!("{t:?} is not a version (1, 2, ...)")))
        };
        let (from_version, to_version) = match s.split_once('-') {
            Some((a, b)) => (version(a)?, version(b)?),
            None => (version(s)?, version(s)?),
        };
        if from_version > to_version {
            return Err(invalid("the first version comes first"));
        }
        Ok(LostRange {
            from_version,
            to_version,
        })
    }
}

/// Appends `loss_acknowledged` for the open loss `lost` names, right after the chain's tip.
pub async fn acknowledge(
    ledger: &Ledger,
    aggregate: AggregateId,
    lost: LostRange,
    reason: String,
    actor: String,
    json: bool,
) -> Result<(), CommandError> {
    if reason.trim().is_empty() {
        return Err(CommandError::BadInput(
            "--reason must say why the state is trusted without the lost versions".into(),
        ));
    }
    let history = ledger.aggregate_history(aggregate).await?;
    let open = HistoryEntry::open_losses(&history);
    let named =
        |l: &&LostVersions| (l.from_version, l.to_version) == (lost.from_version, lost.to_version);
    let Some(loss) = open.as_slice().iter().find(named).copied() else {
        let ranges: Vec<String> = open.as_slice().iter().map(|l| l.range()).collect();
        return Err(if ranges.is_empty() {
            CommandError::Problem(format!(
                "{aggregate} has no open loss: nothing to acknowledge (`{}` shows its chain)",
                super::invocation::current().command(&format!("history {aggregate}"))
            ))
        } else {
            CommandError::BadInput(format!(
                "{aggregate} has lost versions {}; --lost must name one of them exactly",
                ranges.join(", ")
            ))
        });
    };
    let tip = history
        .iter()
        .rev()
        .find_map(HistoryEntry::commit)
        .map_or(0, |c| c.version);
    let draft = CommitDraft::now(actor, vec![Event::loss_acknowledged(&loss, reason)]);
    let outcome = ledger
        .append(aggregate, Expectation::Exactly(tip), draft)
        .await?;
    let still_open = open.as_slice().len() - 1;
    tracing::warn!(%aggregate, lost = %loss.range(), position = outcome.position, "loss acknowledged");
    if json {
        print_json(&serde_json::json!({
            "aggregate": aggregate.to_string(),
            "acknowledged": {"from_version": loss.from_version, "to_version": loss.to_version},
            "version": outcome.version,
            "position": outcome.position,
            "losses_still_open": still_open,
        }));
    } else {
        println!(
            "acknowledged: {aggregate} v{} lost; recorded as v{} at position {}{}",
            loss.range(),
            outcome.version,
            outcome.position,
            match still_open {
                0 => "; the aggregate is read and written again".to_string(),
                n => format!("; {n} more loss(es) to acknowledge"),
            }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_one_version_or_two_in_order() {
        assert_eq!(
            "2".parse(),
            Ok(LostRange {
                from_version: 2,
                to_version: 2
            })
        );
        assert_eq!(
            "2-5".parse(),
            Ok(LostRange {
                from_version: 2,
                to_version: 5
            })
        );
        for bad in ["0", "5-2", "x", "", "2-", "-3"] {
            assert!(bad.parse::<LostRange>().is_err(), "{bad}");
        }
    }
}
