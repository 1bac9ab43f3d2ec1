//! Chat messages rendered into one prompt by a fixed template (the simulator has no model
//! config to take a Jinja template from; a fixed one keeps token ids stable across engines).

use serde_json::Value;

/// Why a `messages` array could not be rendered (a 400 for the client).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChatError {
    #[error("'messages' must be a non-empty array")]
    NotArray,
    #[error("messages[{0}] must be an object with a string 'role'")]
    Role(usize),
    #[error("messages[{0}].content must be a string, null or an array of text parts")]
    Content(usize),
}

/// `<|role|>\ncontent\n` per message, then `<|assistant|>\n` (the generation prompt).
pub fn render(messages: &Value) -> Result<String, ChatError> {
    let list = messages.as_array().filter(|l| !l.is_empty()).ok_or(ChatError::NotArray)?;
    let mut out = String::new();
    for (i, message) in list.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str).ok_or(ChatError::Role(i))?;
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        match message.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => out.push_str(text),
            Some(Value::Array(parts)) => {
                for part in parts {
                    // Non-text parts (images, audio) carry no text the simulator can use.
                    match part.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            out.push_str(part.get("text").and_then(Value::as_str).ok_or(ChatError::Content(i))?)
                        }
                        Some(_) => {}
                        None => return Err(ChatError::Content(i)),
                    }
                }
            }
            Some(_) => return Err(ChatError::Content(i)),
        }
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_messages_and_rejects_bad_shapes() {
        let m = json!([{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]);
        assert_eq!(render(&m).unwrap(), "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
        assert_eq!(render(&json!([])), Err(ChatError::NotArray));
        assert_eq!(render(&json!([{"content": "x"}])), Err(ChatError::Role(0)));
        assert_eq!(render(&json!([{"role": "user", "content": 5}])), Err(ChatError::Content(0)));
    }
}
